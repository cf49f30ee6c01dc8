"""Features that plug into the request loop without changing it: each is called by
``DeviceCalls`` or ``LLMEngine`` at a named point (after a token, before a dispatch, when
a request finishes). ``beam_search_driver`` (beam search on forks), ``structured_outputs``
(grammars and their masks), ``lora_manager`` (adapters by name), ``kv_handoff``
(disaggregated serving's page hand-off), ``logprobs`` (per-token log-probabilities kept
until output) and ``prompt_logits`` (diagnostics)."""
