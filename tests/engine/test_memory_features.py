"""Prefix caching, preemption in both modes, n > 1 copy-on-write, priorities, abort: end to end."""

import pytest

from jaxpage import LLM, SamplingParams
from tests.engine.prompts import BASE
from tests.options import FEW_BUCKETS


def tiny(path, **overrides):
    options = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512, block_size=16,
                   num_kv_blocks=256, **FEW_BUCKETS)
    options.update(overrides)
    return LLM(path, **options)


def test_shared_system_prompt_hits_the_prefix_cache_near_ideally(tiny_checkpoints):
    llm = tiny(tiny_checkpoints["llama"], max_num_seqs=64, num_kv_blocks=1200)
    system = [1000 + (i * 37) % 5000 for i in range(512)]
    prompts = [{"prompt_token_ids": system + [7000 + i, 8000 + i, 9000 + i]} for i in range(64)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    total = sum(len(p["prompt_token_ids"]) for p in prompts)
    ideal = 63 * 512 / total  # every request but the first reuses the 32 system blocks
    rate = llm.get_stats()["prefix_cache_hit_rate"]
    print(f"prefix cache hit rate {rate:.4f}, ideal {ideal:.4f}")
    assert 0.95 * ideal <= rate <= ideal + 1e-9
    assert outs[0].num_cached_tokens == 0 and outs[-1].num_cached_tokens == 512
    # Cached prefixes change nothing in the tokens.
    plain = tiny(tiny_checkpoints["llama"], max_num_seqs=64, num_kv_blocks=1200,
                 enable_prefix_caching=False)
    again = plain.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:8]]
    assert plain.get_stats()["prefix_cache_hit_rate"] == 0.0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_quarter_sized_cache_gives_identical_greedy_outputs(tiny_checkpoints, smollm2_tokenizer,
                                                             mode):
    prompts = BASE[:16]
    max_tokens = 24
    block_size = 8
    needed = sum(-(-(len(smollm2_tokenizer(p).input_ids) + max_tokens) // block_size)
                 for p in prompts)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    roomy = tiny(tiny_checkpoints["llama"], block_size=block_size, num_kv_blocks=needed,
                 max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert roomy.get_stats()["num_preemptions"] == 0
    squeezed = tiny(tiny_checkpoints["llama"], block_size=block_size,
                    num_kv_blocks=needed // 4, max_num_batched_tokens=64, preemption_mode=mode)
    got = [o.outputs[0].token_ids for o in squeezed.generate(prompts, params, use_tqdm=False)]
    stats = squeezed.get_stats()
    print(f"{mode}: {needed} blocks needed, {needed // 4} given, {stats['num_preemptions']} "
          f"preemptions ({stats['num_swap_preemptions']} by swap)")
    assert stats["num_preemptions"] >= 4
    if mode == "swap":
        assert stats["num_swap_preemptions"] == stats["num_preemptions"]
    else:
        assert stats["num_swap_preemptions"] == 0
    assert got == want


def peak_blocks(llm, prompts, params):
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, params) for p in prompts]
    peak, outputs = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        peak = max(peak, engine.num_used_blocks())
    return peak, [outputs[i] for i in ids]


def test_n4_shares_the_prompt_and_copies_on_write(tiny_checkpoints):
    prompt = {"prompt_token_ids": [100 + i for i in range(45)]}  # 45 = 5 blocks of 8, + 5
    llm = tiny(tiny_checkpoints["llama"], block_size=8, enable_prefix_caching=False)
    sampled = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10)
    peak_n4, (out,) = peak_blocks(llm, [prompt], sampled)
    separate = [SamplingParams(temperature=1.0, seed=s, max_tokens=10) for s in range(4)]
    engine = llm.llm_engine
    peak_sep = 0
    ids = [engine.add_request(None, prompt, sp) for sp in separate]
    while engine.has_unfinished_requests():
        engine.step()
        peak_sep = max(peak_sep, engine.num_used_blocks())
    print(f"peak KV blocks: n=4 {peak_n4}, four separate requests {peak_sep}")
    assert len(ids) == 4 and peak_n4 < peak_sep
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # independent random streams
    _, (again,) = peak_blocks(llm, [prompt], sampled)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # Greedy siblings must equal the single greedy answer: the copied blocks are right.
    _, (greedy4,) = peak_blocks(llm, [prompt], SamplingParams(n=4, temperature=0, max_tokens=10))
    _, (greedy1,) = peak_blocks(llm, [prompt], SamplingParams(temperature=0, max_tokens=10))
    assert all(c.token_ids == greedy1.outputs[0].token_ids for c in greedy4.outputs)


def test_priority_policy_serves_lower_values_first(tiny_checkpoints):
    llm = tiny(tiny_checkpoints["llama"], scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate(BASE[:4], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False,
                        priority=[3, 1, 2, 0])
    order = sorted(range(4), key=lambda i: outs[i].metrics["finished_time"])
    assert order == [3, 1, 2, 0]
    with pytest.raises(ValueError, match="2 priorities for 4 prompts"):
        llm.generate(BASE[:4], priority=[1, 2], use_tqdm=False)


def test_abort_at_any_stage_frees_everything(tiny_checkpoints):
    llm = tiny(tiny_checkpoints["llama"], max_num_seqs=4, max_num_batched_tokens=16,
               block_size=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=50)
    long_prompt = {"prompt_token_ids": list(range(100, 140))}
    a = engine.add_request(None, long_prompt, params)                            # mid-prefill
    b = engine.add_request(None, "Hello", SamplingParams(n=3, temperature=1.0, max_tokens=50))
    c = engine.add_request(None, "Hi there", params)                             # waiting
    engine.step()
    assert engine.scheduler.requests[a].num_computed_tokens == 16
    engine.abort_request(a)
    for _ in range(4):
        engine.step()
    engine.abort_request(b)   # a group of 3, decoding
    engine.abort_request(c)
    engine.abort_request("no-such-request")
    stats = llm.get_stats()
    assert not engine.has_unfinished_requests()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
