"""An instance's routes for disaggregated serving: ``GET /kv_layout`` (the proxy checks
that prefill and decode instances agree before it starts) and ``POST
/kv_transfer/settle`` (the proxy says how a ticket's pull ended; ``docs/disaggregated.md``).
"""

from __future__ import annotations

from fastapi import FastAPI

from jaxpage.server.errors import bad_request_from
from jaxpage.server.protocol import SettleKVRequest


def add_kv_routes(app: FastAPI, engine, errors: dict) -> None:
    """The routes above, for ``engine`` (an ``AsyncLLMEngine``)."""
    core = engine.engine

    @app.post("/kv_transfer/settle", responses=errors)
    async def settle_kv(body: SettleKVRequest):
        """A prefill instance: the ticket was pulled (``pulled``), or never will be (its
        pages are then released)."""
        def settle() -> bool:
            settled = core.settle_kv(body.uuid, body.pulled)
            engine.stats = core.get_stats()  # the snapshot /metrics reads, between steps
            return settled

        try:
            settled = await engine.run(settle)
        except ValueError as error:
            raise bad_request_from(error) from None
        return {"settled": settled}

    @app.get("/kv_layout")
    async def kv_layout():
        """How this instance lays out KV pages (``pallas_kernels.kv_layout``)."""
        runner = core.runner
        first = runner.kv_cache[0]             # [L, N, B, Hkv, D] (split) or [L, N, B, W]
        transfer = core.kv_transfer
        return {"kv_role": core.config.cache.kv_role,
                "kv_shards": transfer.kv_shards if transfer is not None else 1,
                "layout": runner.kv_layout,
                "num_layers": first.shape[0], "block_size": first.shape[2],
                "kv_heads": runner.run_arch.num_kv_heads, "head_dim": runner.run_arch.head_dim,
                "dtype": str(first.dtype), "kv_format": runner.kv_format}
