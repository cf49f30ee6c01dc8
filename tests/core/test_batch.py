import numpy as np
import pytest

from jaxpage.core.batch.builder import BatchBuilder, BucketLadder
from jaxpage.core.sched.step_result import StepResult
from tests.core.helpers import make_request, make_scheduler


def test_ladder_rungs_and_fit():
    ladder = BucketLadder(16, 100)
    assert ladder.rungs == (16, 32, 64, 100)
    assert ladder.fit(1) == 16 and ladder.fit(33) == 64 and ladder.fit(100) == 100
    with pytest.raises(ValueError, match="exceeds"):
        ladder.fit(101)


def test_ladder_growth_trades_programs_for_padding():
    assert BucketLadder(16, 512, growth=4).rungs == (16, 64, 256, 512)
    assert BucketLadder(8, 32, growth=4).rungs == (8, 16, 32)  # the minimum is kept
    assert BucketLadder(1, 64, growth=4096).rungs == (1, 64)
    assert BucketLadder(16, 16, growth=4).rungs == (16,)
    with pytest.raises(ValueError, match="growth must be >= 2, got 1"):
        BucketLadder(1, 8, growth=1)
    s = make_scheduler(num_blocks=32, block_size=4)
    few = BatchBuilder(s.kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                       bucket_growth=4096)
    many = BatchBuilder(s.kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    # (T, S) of decodes: 1 sequence alone, else all 8 seats; mixed steps use 16 or 64 tokens
    # and at least T / 8 seats (the 8 of the top rung for both)
    assert few.step_shapes() == [(1, 1, 8), (1, 1, 16), (8, 8, 8), (8, 8, 16), (16, 8, 8),
                                 (16, 8, 16), (64, 8, 8), (64, 8, 16)]
    assert len(many.step_shapes()) >= 2 * len(few.step_shapes())


def test_mixed_prefill_and_decode_batch_layout():
    s = make_scheduler(num_blocks=32, block_size=4)
    builder = BatchBuilder(s.kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    a = make_request("a", 5, temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, seed=3)
    s.add_request(a)
    first = s.schedule()
    s.apply(first, StepResult(np.array([60], np.int32)))
    s.add_request(make_request("b", 3, min_tokens=2, stop_token_ids=[9]))
    batch = builder.build(s.schedule()).metadata
    assert batch.shape_key == (16, 2, 8)
    np.testing.assert_array_equal(batch.input_ids[:4], [60] + make_request("b", 3).prompt_token_ids)
    np.testing.assert_array_equal(batch.positions[:4], [5, 0, 1, 2])
    # a holds blocks [1, 2]: position 5 -> block 2 offset 1 -> slot 9; b holds [3]: slots 12..14
    np.testing.assert_array_equal(batch.slot_mapping[:4], [9, 12, 13, 14])
    assert (batch.slot_mapping[4:] == -1).all() and (batch.input_ids[4:] == 0).all()
    np.testing.assert_array_equal(batch.block_tables, [[1, 2, 0, 0, 0, 0, 0, 0],
                                                       [3, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.kv_lens, [6, 3])
    np.testing.assert_array_equal(batch.cu_q_lens, [0, 1, 4])
    np.testing.assert_array_equal(batch.num_seqs, [2])
    np.testing.assert_array_equal(batch.logits_indices, [0, 3])
    np.testing.assert_allclose(batch.temperature, [0.5, 0.0])
    np.testing.assert_array_equal(batch.top_k, [7, -1])
    np.testing.assert_array_equal(batch.sample_index, [1, 0])
    np.testing.assert_array_equal(batch.stop_token_ids[0, :2], [2, -1])  # EOS only
    np.testing.assert_array_equal(batch.stop_token_ids[1, :3], [2, 9, -1])
    np.testing.assert_array_equal(batch.min_tokens, [0, 2])
    np.testing.assert_array_equal(batch.max_output, [16, 16])


def test_steps_with_prefill_seat_at_least_one_sequence_per_8_tokens():
    """A step with prefill pads S to the rung of max(n, T / 8): one program per token rung
    for every smaller count of sequences. Decodes keep the sequence rung of n."""
    s = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=16, max_num_batched_tokens=128)
    builder = BatchBuilder(s.kv, max_num_batched_tokens=128, max_num_seqs=16, max_model_len=64)
    assert builder.seats(128, 1, decodes_only=False) == 16
    assert builder.seats(64, 1, decodes_only=False) == 8
    assert builder.seats(64, 9, decodes_only=False) == 16
    assert builder.seats(16, 3, decodes_only=False) == 4
    assert builder.seats(128, 1, decodes_only=True) == 1
    s.add_request(make_request("long", 40, max_tokens=2))        # 40 tokens: rung 64
    batch = builder.build(s.schedule()).metadata
    assert batch.shape_key == (64, 8, 16)
    np.testing.assert_array_equal(batch.num_seqs, [1])
    np.testing.assert_array_equal(batch.kv_lens, [40] + [0] * 7)
    np.testing.assert_array_equal(batch.cu_q_lens, [0] + [40] * 8)
    np.testing.assert_array_equal(batch.logits_indices, [39] + [0] * 7)
    assert batch.shape_key in set(builder.step_shapes())
    # no (T, S) pair of a step with prefill has fewer than T / 8 seats
    assert all(s_ >= min(t // 8, 16) for t, s_, _ in builder.step_shapes() if t >= 16)


def test_padding_sequences_repeat_the_last_offset():
    s = make_scheduler(num_blocks=32, block_size=4)
    builder = BatchBuilder(s.kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    for name in "abc":
        s.add_request(make_request(name, 2))
    batch = builder.build(s.schedule()).metadata
    assert batch.block_tables.shape[0] == 4
    np.testing.assert_array_equal(batch.cu_q_lens, [0, 2, 4, 6, 6])
    np.testing.assert_array_equal(batch.kv_lens, [2, 2, 2, 0])


def test_enumerated_shapes_cover_every_batch_the_builder_makes():
    import itertools

    s = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=6, max_num_batched_tokens=40)
    builder = BatchBuilder(s.kv, max_num_batched_tokens=40, max_num_seqs=6, max_model_len=64)
    shapes = set(builder.step_shapes())
    decode = set(builder.decode_shapes())
    assert decode <= shapes
    seen = set()
    for n, extra in itertools.product(range(1, 7), (0, 3, 9, 30)):
        s = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=6, max_num_batched_tokens=40)
        builder = BatchBuilder(s.kv, max_num_batched_tokens=40, max_num_seqs=6, max_model_len=64)
        for i in range(n):
            s.add_request(make_request(f"r{i}", 1 + (extra if i == 0 else 0), max_tokens=3))
        batch = builder.build(s.schedule()).metadata
        seen.add(batch.shape_key)
        assert batch.shape_key in shapes
        empty = builder.empty(*batch.shape_key)
        assert {k: (v.shape, v.dtype) for k, v in empty.as_dict().items()} == \
               {k: (v.shape, v.dtype) for k, v in batch.as_dict().items()}
    assert len(seen) > 4


def test_decode_seats_have_three_quarter_rungs_from_32():
    """Power-of-two decode rungs from 32 seats up have a rung at 3/4 below them (24, 48,
    96); a top rung that is not a power of two (100) gets none; decode_shapes lists them."""
    from jaxpage.core.batch.batch_shapes import BatchShapes

    shapes = BatchShapes(max_num_batched_tokens=512, max_num_seqs=64, max_blocks=8)
    seats = {n: shapes.decode_seats(n) for n in range(1, 65)}
    assert sorted(set(seats.values())) == [1, 8, 16, 24, 32, 48, 64]
    assert [seats[n] for n in (16, 17, 24, 25, 32, 33, 48, 49, 64)] == \
        [16, 24, 24, 32, 32, 48, 48, 64, 64]
    assert {(t, s) for t, s, _ in shapes.decode_shapes()} == \
        {(1, 1), (8, 8), (16, 16), (24, 24), (32, 32), (48, 48), (64, 64)}
    odd = BatchShapes(max_num_batched_tokens=512, max_num_seqs=100, max_blocks=8)
    assert [odd.decode_seats(n) for n in (65, 96, 100)] == [100, 100, 100]
    assert [odd.decode_seats(n) for n in (40, 48, 49)] == [48, 48, 64]
    small = BatchShapes(max_num_batched_tokens=512, max_num_seqs=16, max_blocks=8)
    assert sorted({small.decode_seats(n) for n in range(1, 17)}) == [1, 8, 16]


@pytest.mark.parametrize("n, tokens", [(1, 1), (2, 6), (3, 6), (5, 6), (6, 6)])
def test_decode_only_batches_pad_tokens_like_sequences(n, tokens):
    """Decodes pad T to their seats (1 alone, else at least min(8, the top rung 6)), not to
    the token ladder's 16; the token rung caps it when the token ladder is the smaller one."""
    s = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=6, max_num_batched_tokens=40)
    builder = BatchBuilder(s.kv, max_num_batched_tokens=40, max_num_seqs=6, max_model_len=64)
    for i in range(n):
        s.add_request(make_request(f"r{i}", 3, max_tokens=5))
    prefill = s.schedule()
    assert builder.build(prefill).metadata.shape_key[0] == builder.token_ladder.fit(3 * n) >= 16
    s.apply(prefill, StepResult(np.full(n, 7, np.int32)))
    batch = builder.build(s.schedule()).metadata
    assert batch.shape_key == (tokens, tokens, 8)
    assert batch.shape_key in set(builder.decode_shapes()) <= set(builder.step_shapes())
    np.testing.assert_array_equal(batch.input_ids[:n], [7] * n)
    np.testing.assert_array_equal(batch.slot_mapping[n:], [-1] * (tokens - n))
    capped = BatchBuilder(s.kv, max_num_batched_tokens=4, max_num_seqs=6, max_model_len=64)
    assert capped.decode_tokens(3) == 4 and capped.decode_tokens(1) == 1
    wide = BatchBuilder(s.kv, max_num_batched_tokens=64, max_num_seqs=32, max_model_len=64)
    assert [wide.decode_seats(n) for n in (1, 2, 7, 8, 9, 17, 24, 25)] == [1, 8, 8, 8, 16, 24, 24, 32]
