"""bench_spec_decode's workload and table, and n-gram speculation on SmolLM2 asked to quote
its input: real prompt-lookup hits, the plain greedy tokens."""

import pytest

import bench_spec_decode
from jaxpage import LLM, SamplingParams


def test_passages_are_real_repository_text():
    passages = bench_spec_decode.passages(8)
    assert len(passages) == 8 and len(set(passages)) == 8
    assert all(len(p) >= 300 for p in passages)
    assert "jaxpage" in " ".join(passages)


def test_the_script_checks_outputs_and_writes_its_table(tmp_path):
    rows = bench_spec_decode.main(["--model", "preset:tiny-llama", "--batches", "1,2",
                                   "--max-tokens", "12", "--out", str(tmp_path)])
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["identical_outputs"] and r["plain_tok_s"] > 0 for r in rows)
    assert (tmp_path / "spec_decode.md").exists() and (tmp_path / "spec_decode.json").exists()


@pytest.mark.slow
def test_smollm2_quoting_prompts_match_plain_decoding_with_real_ngram_hits():
    """16 prompts in one batch: prompt lookup finds proposals the target accepts, and the
    outputs are plain decoding's greedy tokens."""
    options = dict(max_num_seqs=16, enable_prefix_caching=False, max_num_batched_tokens=1024)
    plain = LLM(**options)
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "disable_by_batch_size": 16}, **options)
    prompts = bench_spec_decode.prompts_for(plain.get_tokenizer(), 16)
    params = SamplingParams(temperature=0, max_tokens=32)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = spec.get_stats()
    assert stats["spec_num_accepted_tokens"] > 50, stats
    assert stats["spec_mean_accepted_length"] > 1.5, stats
