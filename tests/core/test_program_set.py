"""The program set: additive ladders, the ready set, and padding a batch into a larger
program (``core.batch.batch_shapes`` additive mode, ``core.batch.program_set``)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpage.core.batch.batch_metadata import BatchMetadata
from jaxpage.core.batch.batch_shapes import BatchShapes, ladder_policy
from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.batch.program_set import ProgramKey, pad_batch, program_set, smallest_holding


def _shapes(**overrides):
    options = dict(max_num_batched_tokens=1024, max_num_seqs=256, max_blocks=512,
                   one_block_rung=True, additive=True)
    return BatchShapes(**{**options, **overrides})


def test_ladder_policy_per_platform_and_kernel():
    assert ladder_policy("cpu", "cpu") == {"one_block_rung": True, "additive": False}
    assert ladder_policy("cpu", "reference") == {"one_block_rung": False, "additive": False}
    assert ladder_policy("gpu", "gpu") == {"one_block_rung": True, "additive": True}
    assert ladder_policy("tpu", "reference") == {"one_block_rung": False, "additive": True}


def test_additive_seats_follow_the_token_rung_and_decodes_share_the_token_ladder():
    shapes = _shapes()
    assert shapes.seats(1024, 1, decodes_only=False) == 256
    assert shapes.seats(64, 3, decodes_only=False) == 64
    assert [shapes.decode_seats(n) for n in (1, 16, 17, 100, 256)] == [16, 16, 32, 128, 256]
    assert [shapes.decode_tokens(n) for n in (1, 17, 256)] == [16, 32, 256]
    assert len(shapes.step_shapes()) == 7 and len(shapes.decode_shapes()) == 5
    # a ceiling that is not a power of two is a rung of its own
    odd = _shapes(max_num_seqs=300)
    assert odd.decode_ladder.rungs[-1] == 300 and (300, 300, 512) in odd.step_shapes()
    # fewer tokens than sequences: decodes stop at the token budget
    few = _shapes(max_num_batched_tokens=64)
    assert few.decode_ladder.rungs == (16, 32, 64)


def test_product_ladders_stay_on_the_cpu():
    cpu = _shapes(additive=False, one_block_rung=False)
    assert len(cpu.step_shapes()) > 7 * 7


def test_the_ready_set_is_the_largest_device_decided_program_of_each_kind():
    programs = program_set(_shapes(), num_steps=8, host_decides=True, move_sizes=[1, 4, 16],
                           penalty_width=512)
    assert [k.label for k in programs.ready] == [
        "step(device-decided)[1024, 256, 512]", "decode8(device-decided)[256, 256, 512]",
        "move_blocks[16]", "penalty_fill[512]"]
    assert not set(programs.ready) & set(programs.background)
    # largest first, the host-decided program before its device-decided twin
    first = programs.background[:3]
    assert [k.label for k in first] == ["step[1024, 256, 512]", "step[512, 256, 512]",
                                        "step(device-decided)[512, 256, 512]"]


def test_smallest_holding_picks_the_smallest_built_program_that_runs_the_batch():
    built = [ProgramKey("step", (64, 64, 8), 1, True), ProgramKey("step", (256, 64, 8), 1, False),
             ProgramKey("step", (1024, 256, 8), 1, True), ProgramKey("decode", (64, 64, 8), 8)]
    host_decided = ProgramKey("step", (32, 32, 8), 1, False)
    assert smallest_holding(host_decided, built) == built[0]  # device-decided runs any batch
    device = ProgramKey("step", (128, 64, 8), 1, True)
    assert smallest_holding(device, built) == built[2]  # (256, 64) is host-decided only
    assert smallest_holding(ProgramKey("step", (2048, 1, 8), 1, True), built) is None
    assert smallest_holding(ProgramKey("decode", (16, 16, 8), 4), built) is None  # other K


def test_a_key_names_every_variant_fact():
    """``ProgramKey.of`` keeps the invariants; ``name`` / ``file_name`` tell every fact
    apart (what the executable cache saves programs under), ``label`` stays short."""
    from jaxpage.core.batch.step_features import BASE_FEATURES

    host = ProgramKey.of("decode", (8, 8, 4), BASE_FEATURES, host_decides=True, steps=4,
                         draft_rows=3, fixed_length=True)
    assert (host.steps, host.device_decided, host.draft_rows, host.fixed_length) == (
        4, False, 0, True)
    assert host.name == "decode4+sampled+fixed"
    assert host.file_name == "decode4+sampled+fixed-8x8x4.bin"
    device = ProgramKey.of("decode", (8, 8, 4), None, host_decides=True, steps=4,
                           fixed_length=True)
    assert device.device_decided and device.name == "decode4+fixed" and device.holds(host)
    assert not ProgramKey.of("decode", (8, 8, 4), None, host_decides=True, steps=4).holds(host)
    assert not host.holds(device) and host.label == "decode4[8, 8, 4]"
    verify = ProgramKey.of("verify", (16, 4, 4), None, host_decides=False, steps=4, draft_rows=8)
    assert (verify.steps, verify.draft_rows, verify.device_decided) == (1, 8, False)
    assert verify.name == "verify-q8" and verify.label == "verify[16, 4, 4]"
    assert not verify.holds(ProgramKey.of("verify", (16, 4, 4), None, host_decides=False,
                                          draft_rows=1))  # another Q: another program
    assert ProgramKey("move_blocks", (32,)).file_name == "move_blocks-32.bin"
    # the engine's set: the variants' features and the loops' length in every key
    programs = program_set(_shapes(), num_steps=8, host_decides=True, move_sizes=[1],
                           penalty_width=512, fixed_decode=True)
    decodes = [k for k in programs.all if k.kind == "decode"]
    assert decodes and all(k.fixed_length and k.steps == 8 for k in decodes)
    assert {k.features for k in decodes} == {BASE_FEATURES, None}
    assert all((k.features is None) == k.device_decided for k in decodes)


def _builder():
    kv = KVCacheManager(BlockPool(64), 4)
    return BatchBuilder(kv, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64)


def test_pad_batch_follows_the_padding_rules():
    builder = _builder()
    batch = builder.empty(8, 2, 4)
    batch.input_ids[:3] = [5, 6, 7]
    batch.slot_mapping[:3] = [9, 10, 11]
    batch.cu_q_lens[:] = [0, 2, 3]
    batch.num_seqs[0] = 2
    batch.kv_lens[:2] = [2, 1]
    batch.block_tables[:2, :1] = [[3], [4]]
    batch.temperature[:2] = 0.7
    batch.penalty_slot[:2] = [0, 1]
    padded = pad_batch(batch, builder.empty(16, 4, 8))
    assert padded.shape_key == (16, 4, 8)
    np.testing.assert_array_equal(padded.input_ids[:4], [5, 6, 7, 0])
    np.testing.assert_array_equal(padded.slot_mapping[:4], [9, 10, 11, -1])
    np.testing.assert_array_equal(padded.cu_q_lens, [0, 2, 3, 3, 3])
    np.testing.assert_array_equal(padded.block_tables[:, 0], [3, 4, 0, 0])
    np.testing.assert_array_equal(padded.block_tables[:, 1:], 0)
    np.testing.assert_array_equal(padded.temperature, np.float32([0.7, 0.7, 0, 0]))
    np.testing.assert_array_equal(padded.penalty_slot, [0, 1, -1, -1])
    np.testing.assert_array_equal(padded.top_p, [1, 1, 1, 1])
    np.testing.assert_array_equal(padded.stop_token_ids[2:], -1)
    assert padded.num_seqs[0] == 2
    assert padded.step_features() == batch.step_features()
    with pytest.raises(ValueError, match="cannot pad"):
        pad_batch(padded, builder.empty(8, 2, 4))
