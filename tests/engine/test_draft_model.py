"""Speculative decoding with a draft model (``method="draft_model"``) never changes what
the target says, and its paged KV cache on the target's blocks stays exact.

Drafts used: the target itself (every proposal must be accepted: a single stale or
misplaced draft K/V entry breaks it), the target with a little noise in its weights
(about half the proposals accepted: every accept length happens), and a small-vocabulary
pair for the chi-square test.
"""

import numpy as np
import pytest

from jaxpage import LLM, SamplingParams
from tests.default_suite import every_nth
from tests.engine.outcomes import outcomes
from tests.engine.prompts import BASE
from tests.engine.test_speculative import mixed_params
from tests.options import TINY
from tests.reference import make_perturbed_checkpoint, make_token_id_checkpoint


def draft_config(model: str, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k,
            "disable_by_batch_size": 8, **extra}  # 8: every seat of TINY


@pytest.fixture(scope="module")
def noisy_llama(tiny_checkpoints, tmp_path_factory):
    return make_perturbed_checkpoint(tiny_checkpoints["llama"],
                                     str(tmp_path_factory.mktemp("noisy") / "llama"), noise=0.01)


@pytest.fixture(scope="module")
def plain_llama(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], **TINY)


@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_draft_equal_to_target_accepts_every_proposal(tiny_checkpoints, kind):
    path = tiny_checkpoints[kind]
    k = 3
    plain = LLM(path, **TINY)
    spec = LLM(path, speculative_config=draft_config(path, k), **TINY)
    prompts = BASE[:4]
    params = SamplingParams(temperature=0, max_tokens=1 + (k + 1) * 6)  # 6 full verify steps
    assert outcomes(spec, prompts, params) == outcomes(plain, prompts, params)
    stats = spec.get_stats()
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_mean_accepted_length"] == k + 1
    assert stats["spec_num_drafts"] == 4 * 6


def greedy_rows_equal(got, want, params) -> int:
    """Greedy rows equal token for token; sampled rows (distributed as plain decoding's,
    not drawn the same: the rejection sampler) end as their settings allow. Returns the
    number of sampled completions checked."""
    sampled = 0
    for g, w, p in zip(got, want, params):
        assert len(g) == len(w) == p.n
        if p.temperature == 0:
            assert g == w
            continue
        for tokens, _, reason, _ in g:
            sampled += 1
            assert reason in ("stop", "length") and 1 <= len(tokens) <= p.max_tokens
    return sampled


def test_noisy_draft_outputs_equal_plain_decoding(tiny_checkpoints, noisy_llama, plain_llama):
    """16 prompts in one batch, chunked prefill, greedy rows with stop ids and strings
    inside accepted runs equal plain decoding's; sampled rows (seeds, top-k/p, min-p,
    logprobs, n=2, penalties) run through the rejection sampler alongside them."""
    spec = LLM(tiny_checkpoints["llama"], speculative_config=draft_config(noisy_llama),
               **TINY)
    prompts = BASE[:16]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    free = outcomes(plain_llama, prompts[:8], greedy)
    params = mixed_params(free) + [greedy] * 8
    assert greedy_rows_equal(outcomes(spec, prompts, params),
                             outcomes(plain_llama, prompts, params), params) == 4
    stats = spec.get_stats()
    assert 0.1 < stats["spec_acceptance_rate"] < 0.9, stats  # accepts and rejects both happen
    shapes = spec.llm_engine.draft_proposer.compiled_shapes
    assert any(name == "fill" for name, *_ in shapes)  # prompts were caught up in chunks


@pytest.mark.parametrize("mode", [pytest.param("recompute", marks=pytest.mark.slow), "swap"])
def test_preemption_with_a_draft_model_matches_plain(tiny_checkpoints, noisy_llama, mode):
    """Few KV blocks: requests are preempted (both modes) between verify steps, so the
    draft's state is dropped and rebuilt; outputs match plain decoding and every block is
    free afterwards (the suite's autouse check)."""
    path = tiny_checkpoints["llama"]
    options = {**TINY, "num_kv_blocks": 40, "preemption_mode": mode}
    plain = LLM(path, **options)
    spec = LLM(path, speculative_config=draft_config(noisy_llama), **options)
    prompts = (BASE * 2)[:12]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=48)
              for i in range(12)]
    assert greedy_rows_equal(outcomes(spec, prompts, params), outcomes(plain, prompts, params),
                             params) == 6
    assert spec.get_stats()["num_preemptions"] > 0
    assert spec.get_stats()["spec_num_accepted_tokens"] > 0


def test_draft_programs_are_compiled_by_warmup(tiny_checkpoints, noisy_llama):
    spec = LLM(tiny_checkpoints["llama"], speculative_config=draft_config(noisy_llama),
               warmup=True, **TINY)
    proposer = spec.llm_engine.draft_proposer
    warmed = set(proposer.compiled_shapes)
    programs = spec.llm_engine.runner.executables
    built, compiled = set(programs.programs()), len(programs.compiles)
    spec.generate(BASE[:6], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert proposer.compiled_shapes == warmed
    assert set(programs.programs()) == built and len(programs.compiles) == compiled


def test_draft_model_configs_are_checked(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match="vocab"):  # a preset's vocabulary is not SmolLM2's
        LLM(path, speculative_config=draft_config("preset:tiny-llama"), **TINY)
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(path, speculative_config={"method": "draft_model"}, **TINY)
    with pytest.raises(ValueError, match="only"):
        LLM(path, speculative_config={"method": "ngram", "model": path}, **TINY)


def chi_square_threshold(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at significance ~0.001 (z = 3.09), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def two_sample_chi_square(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic that two samples of categories share one distribution, over
    the categories both see at least 5 times between them; and its degrees of freedom."""
    categories = np.union1d(a, b)
    ca = np.array([(a == c).sum() for c in categories], float)
    cb = np.array([(b == c).sum() for c in categories], float)
    keep = ca + cb >= 5
    ca, cb = ca[keep], cb[keep]
    na, nb = ca.sum(), cb.sum()
    expected_a = (ca + cb) * na / (na + nb)
    expected_b = (ca + cb) * nb / (na + nb)
    stat = float((((ca - expected_a) ** 2) / expected_a).sum()
                 + (((cb - expected_b) ** 2) / expected_b).sum())
    return stat, len(ca) - 1


@pytest.mark.parametrize("top_p", every_nth([0.8, 1.0], 2))  # 1.0: slow
def test_sampled_tokens_keep_their_distribution_with_a_bad_draft(tmp_path, top_p):
    """Small vocabulary (24 ids), a deliberately bad draft (the target with noise in its
    weights: most proposals rejected): the 2nd and 3rd sampled tokens of 1,500 seeded
    requests with speculation (the min(1, p/q) / (p - q)+ rejection sampler) and of 1,500
    differently seeded requests without it pass a two-sample chi-square test at ~0.001."""
    target = make_token_id_checkpoint(str(tmp_path / "target"), vocab_size=24, seed=5)
    draft = make_perturbed_checkpoint(target, str(tmp_path / "draft"), noise=0.2)
    options = {**TINY, "max_num_seqs": 32, "num_kv_blocks": 256, "max_num_batched_tokens": 256}
    plain = LLM(target, **options)
    spec = LLM(target, speculative_config=draft_config(draft, 3, disable_by_batch_size=32),
               **options)
    prompt = {"prompt_token_ids": [3, 7, 11, 5, 2, 9]}
    n = 1500

    def sample(llm, first_seed):
        rows = []
        for start in range(0, n, 32):  # rounds of 32: every decode step speculates
            params = [SamplingParams(temperature=1.0, top_p=top_p, seed=first_seed + s,
                                     max_tokens=3, ignore_eos=True)
                      for s in range(start, min(n, start + 32))]
            rows += [o.outputs[0].token_ids
                     for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
        return np.array(rows)

    with_draft, without = sample(spec, 0), sample(plain, 10_000)
    stats = spec.get_stats()
    assert stats["spec_num_drafts"] >= n  # every request's 2nd token came from a verify step
    assert 0.05 < stats["spec_acceptance_rate"] < 0.8, stats  # accepts and rejections
    for position in (1, 2):
        stat, df = two_sample_chi_square(with_draft[:, position], without[:, position])
        assert df >= 3
        assert stat < chi_square_threshold(df), (position, stat, df)


@pytest.mark.slow
def test_smollm2_with_itself_as_draft_equals_plain(smollm2_path):
    options = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64)
    plain = LLM(smollm2_path, **options)
    spec = LLM(smollm2_path, speculative_config=draft_config(smollm2_path, 4), **options)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
               "Write a haiku about the sea."]
    params = SamplingParams(temperature=0, max_tokens=24)
    assert outcomes(spec, prompts, params) == outcomes(plain, prompts, params)
    assert spec.get_stats()["spec_acceptance_rate"] == 1.0


@pytest.mark.slow
def test_qwen2_noisy_draft_greedy_equals_plain(tiny_checkpoints, tmp_path):
    """16 prompts in one batch, chunked prefill (64-token budget), greedy, a Qwen2 target
    with a noisy copy of itself as draft."""
    path = tiny_checkpoints["qwen2"]
    draft = make_perturbed_checkpoint(path, str(tmp_path / "draft"), noise=0.01)
    plain = LLM(path, **TINY)
    spec = LLM(path, speculative_config=draft_config(draft), **TINY)
    params = SamplingParams(temperature=0, max_tokens=32)
    assert outcomes(spec, BASE[:16], params) == outcomes(plain, BASE[:16], params)
    assert 0.1 < spec.get_stats()["spec_acceptance_rate"] < 1.0
