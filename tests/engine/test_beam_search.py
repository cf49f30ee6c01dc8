"""Beam search inside the engine equals a brute-force beam search over Hugging Face."""

import numpy as np
import pytest

from jaxpage import BeamSearchParams, LLM
from jaxpage.beam_search import beam_score
from tests.default_suite import every_nth
from tests.reference import load_hf_model
from tests.options import FEW_BUCKETS


def brute_force_beam_search(model, prompt, params, eos_ids):
    """The same rules as BeamSearchParams documents, recomputing every beam from scratch."""
    import torch

    width = 2 * params.beam_width
    beams = [(list(prompt), 0.0)]
    completed = []
    for _ in range(params.max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, -1)
            values, ids = torch.topk(logprobs, width)
            for token, lp in zip(ids.tolist(), values.tolist()):
                if token in eos_ids and not params.ignore_eos:
                    completed.append((tokens + [token], cum + lp))
                else:
                    candidates.append((tokens + [token], cum + lp))
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[:params.beam_width]
        if not beams:
            break
    completed.extend(beams)
    completed.sort(key=lambda c: -beam_score(c[0], c[1], eos_ids, params.length_penalty))
    return completed[:params.beam_width]


@pytest.mark.parametrize("kind", every_nth(["llama", "qwen2"], 2))  # qwen2: slow
def test_beam_search_equals_brute_force_hf(kind, tiny_checkpoints, smollm2_tokenizer):
    path = tiny_checkpoints[kind]
    llm = LLM(path, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
              num_kv_blocks=96, **FEW_BUCKETS)
    params = BeamSearchParams(beam_width=4, max_tokens=10)
    prompts = ["Hello, my name is", "The three primary colors are red, green and"]
    outs = llm.beam_search([{"prompt_token_ids": smollm2_tokenizer(p).input_ids} for p in prompts],
                           params)
    hf = load_hf_model(path)
    eos = llm.llm_engine.eos_token_ids
    for prompt, out in zip(prompts, outs):
        ids = smollm2_tokenizer(prompt).input_ids
        want = brute_force_beam_search(hf, ids, params, eos)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        np.testing.assert_allclose([s.cum_logprob for s in out.sequences],
                                   [w[1] for w in want], rtol=1e-4, atol=1e-4)
        for seq in out.sequences:
            assert np.isclose(sum(seq.logprobs), seq.cum_logprob, atol=1e-4)
            assert seq.text == smollm2_tokenizer.decode(seq.tokens[len(ids):],
                                                        skip_special_tokens=True)


def test_beam_search_shares_blocks_and_frees_them(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, block_size=4, num_kv_blocks=96,
              enable_prefix_caching=False, **FEW_BUCKETS)
    engine = llm.llm_engine
    engine.add_beam_search("s", {"prompt_token_ids": list(range(100, 130))},
                           BeamSearchParams(beam_width=4, max_tokens=6))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.num_used_blocks())
    # 4 beams of 36 tokens alone would need 4 * 9 = 36 blocks; sharing the prompt needs far fewer.
    assert peak <= 8 + 4 * 2, peak
    assert len(engine.beam_search.results.pop("s").sequences) == 4


def test_beam_search_params_validation():
    with pytest.raises(ValueError, match="beam_width=0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width=11"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
