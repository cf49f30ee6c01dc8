"""What a generate call produced, as plain tuples tests can compare across engines."""


def outcomes(llm, prompts, params, eos=None):
    """Per request, per completion: (token ids, text, finish reason, stop reason).

    ``eos``: a token id to treat as the end of sequence for this call only (tiny random
    checkpoints rarely produce their real EOS)."""
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    if eos is not None:
        engine.eos_token_ids = frozenset({eos})
    try:
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        engine.eos_token_ids = saved
