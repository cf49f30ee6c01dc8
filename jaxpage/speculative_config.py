"""Speculative decoding's settings (vLLM's ``speculative_config``), checked as they are made.

``SchedulerConfig.speculative`` builds one from the dict a user passes; the scheduler's
proposers (``core.sched.speculation``, ``runtime.draft_model``) read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxpage.checks import require

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, under vLLM's ``speculative_config`` names.

    ``method="ngram"``: prompt lookup (``jaxpage.core.sched.ngram_proposer``): the tokens that
    followed the first earlier occurrence of the sequence's longest recurring suffix of
    ``prompt_lookup_min``..``prompt_lookup_max`` tokens. Up to ``num_speculative_tokens``
    proposals per sequence are verified by the target model in one step. A step with more
    than ``disable_by_batch_size`` running sequences does not speculate (its verification
    would cost more than the steps it saves: see docs/speculative_decoding.md).

    ``method="draft_model"``: ``model`` (a path or preset the loader reads, sharing the
    target's vocabulary) proposes ``num_speculative_tokens`` tokens greedily on the device,
    from its own paged KV cache addressed by the target's block tables
    (``jaxpage.runtime.draft_model``). The prompt-lookup bounds do not apply to it.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 4
    model: str | None = None  # the draft model (method "draft_model" only)

    @classmethod
    def from_dict(cls, options: dict) -> "SpeculativeConfig":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        require(not unknown, f"unknown speculative_config key(s) {unknown}; accepted: {names}")
        options = dict(options)
        # vLLM: one of the lookup bounds alone sets both.
        if "prompt_lookup_max" in options and "prompt_lookup_min" not in options:
            options["prompt_lookup_min"] = min(cls.prompt_lookup_min, options["prompt_lookup_max"]) \
                if isinstance(options["prompt_lookup_max"], int) else options["prompt_lookup_max"]
        if "prompt_lookup_min" in options and "prompt_lookup_max" not in options:
            options["prompt_lookup_max"] = max(cls.prompt_lookup_max, options["prompt_lookup_min"]) \
                if isinstance(options["prompt_lookup_min"], int) else options["prompt_lookup_min"]
        return cls(**options)

    def __post_init__(self) -> None:
        require(self.method in SPECULATIVE_METHODS,
                f"speculative_config method={self.method!r} is not supported; choose one of "
                f"{SPECULATIVE_METHODS}")
        if self.method == "draft_model":
            require(isinstance(self.model, str) and self.model != "",
                    f"speculative_config method='draft_model' needs 'model' (a checkpoint "
                    f"path or preset), got model={self.model!r}")
        else:
            require(self.model is None, f"speculative_config model={self.model!r} is only "
                    "for method='draft_model'")
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1),
                          ("prompt_lookup_max", 1), ("disable_by_batch_size", 1)):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                    f"speculative_config {name}={value!r} must be an integer >= {low}")
        require(self.num_speculative_tokens <= 16,
                f"speculative_config num_speculative_tokens={self.num_speculative_tokens} "
                "must be <= 16")
        require(self.prompt_lookup_min <= self.prompt_lookup_max,
                f"speculative_config prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}")
