"""Turns user prompts and sampling params into validated Requests (nothing is queued here).

Every check that can fail on user input happens here, before a request reaches the
scheduler, and raises ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import hashlib
from typing import Any

from jaxpage.core.request import MAX_STOP_TOKENS
from jaxpage.core.request import Request, derive_sample_seed
from jaxpage.sampling_params import SamplingParams

PromptInput = str | dict[str, Any]


def _stable_seed(text: str) -> int:
    """A 64-bit seed from text, the same in every process (str hashes are salted)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class InputProcessor:
    """Validates prompts against the model, the context and the cache; builds Requests.

    ``num_blocks_for`` maps a token count to KV blocks; ``num_kv_blocks`` is the cache size.
    """

    def __init__(self, *, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: frozenset[int], engine_seed: int, max_num_seqs: int,
                 num_blocks_for, num_kv_blocks: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.engine_seed = engine_seed
        self.max_num_seqs = max_num_seqs
        self.num_blocks_for = num_blocks_for
        self.num_kv_blocks = num_kv_blocks

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(prompt text, prompt token ids) for a string, {"prompt": ...} or {"prompt_token_ids": ...}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or any(
                        not isinstance(t, int) or isinstance(t, bool) for t in ids):
                    raise ValueError(f"prompt_token_ids={ids!r} must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt dict {prompt!r} needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt={prompt!r} must be a string or a dict with 'prompt' or "
                             "'prompt_token_ids'")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        return prompt, list(self.tokenizer(prompt).input_ids)

    def make_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                     priority: int = 0) -> Request:
        """Validate a prompt and its sampling params into a Request.

        With ``n > 1`` the request leads ``n - 1`` siblings (ids ``"<id>#<i>"``), each with
        its own random stream, that fork from it once the prompt is in.
        """
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} must be an integer")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r} must be a SamplingParams")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError(f"prompt={prompt!r} is empty (it has no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len={self.max_model_len}"
                             " (the prompt plus at least one generated token must fit)")
        biased = [t for t in (params.logit_bias or ()) if t >= self.vocab_size]
        if biased:
            raise ValueError(f"logit_bias names token ids {biased[:5]} outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        seed = params.seed if params.seed is not None else _stable_seed(
            f"{self.engine_seed}:{request_id}")
        request = Request(request_id, ids, params, max_model_len=self.max_model_len,
                          eos_token_ids=self.eos_token_ids, sample_seed=derive_sample_seed(seed),
                          prompt=text, priority=priority)
        request.fork_children = [
            request.fork(f"{request_id}#{i}", derive_sample_seed(_stable_seed(f"{seed}:sibling:{i}")))
            for i in range(1, params.n)]
        if params.min_tokens and len(request.stop_token_ids_to_suppress) > MAX_STOP_TOKENS:
            raise ValueError(f"min_tokens={params.min_tokens} with more than "
                             f"{MAX_STOP_TOKENS} stop token ids is not supported")
        needed = self.num_blocks_for(request.num_prompt_tokens + request.max_tokens)
        if needed > self.num_kv_blocks:
            raise ValueError(f"request needs up to {needed} KV blocks (prompt {len(ids)} + "
                             f"max_tokens {request.max_tokens}) but the cache has only "
                             f"{self.num_kv_blocks}; lower max_tokens or raise num_kv_blocks")
        return request
