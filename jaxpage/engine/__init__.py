"""The request loop: ``LLM`` (offline), ``AsyncLLMEngine`` (many asyncio callers, the
server's) and under both ``LLMEngine``, which wires the core, the runtime and the
features together and steps them. ``device_calls.DeviceCalls`` takes each device call
through its life (schedule, dispatch, overlap, wait, apply); ``input_processor``,
``output_processor`` and ``request_groups`` turn prompts into requests and requests into
outputs. ``startup`` holds what runs before the first request (cache sizing, KV scale
calibration, warm-up, building replicas); ``features`` the second-wave features that
plug into the loop through callbacks and fields (beam search, structured outputs,
LoRA adapters, disaggregated KV hand-off, log-probabilities, prompt logits)."""
