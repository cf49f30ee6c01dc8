"""Disaggregated serving inside one engine: the prefill side hands a request's prompt
pages over, the decode side takes them (``docs/disaggregated.md``).

* **Prefill instance** (``kv_role="prefill"``): a request added with
  ``kv_transfer_params={"do_remote_decode": True}`` runs its prompt and samples its first
  token as usual (the proxy sends ``max_tokens=1``). When it finishes at that limit its
  prompt pages are gathered and offered on the transfer server (``offer_pages``, which
  ``DeviceCalls`` calls after each step), and its final output carries the ticket in
  ``RequestOutput.kv_transfer_params``: address, id, shape, the prompt ids and the tokens
  sampled so far. Its KV blocks are free at once (the gathered copy is the transfer's).
* **Decode instance** (``kv_role="decode"``): a request added with that ticket pulls the
  pages (``LLMEngine.pull_kv``, off the engine thread, with a deadline), then ``install``s them
  as a swapped-out request's host blocks with the first token already in its output; the
  scheduler swaps it in (sharing the leading blocks its prefix cache already holds) and
  decodes it with its own multi-step, prefix caching and preemption, as if it had run the
  prompt itself. Its random stream continues at output
  number 1, so a seeded request samples what a colocated engine would.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxpage.core.request import Request
from jaxpage.engine.features.structured_outputs import advance
from jaxpage.runtime.kv_transfer import KVTransfer, TransferTicket

Pages = tuple  # of np.ndarray, one per cache array: [layers, num_blocks, block_size, ...]


class NoRoomForPages(RuntimeError):
    """The decode instance's host pool cannot hold a request's pages now (try later)."""


def start_kv_transfer(role: str | None, runner: Any, parallel: Any,
                      timeout_s: float = 30.0) -> KVTransfer | None:
    """The engine's transfer server for ``role`` (None: not disaggregated). Under tensor
    parallelism pages move shard by shard (``KVTransfer``)."""
    if role is None:
        return None
    if parallel.data_parallel_size > 1 or parallel.num_processes > 1:
        raise ValueError(f"kv_role={role!r} is not supported with data_parallel_size > 1 or "
                         "several processes; start one instance per replica "
                         "(tensor_parallel_size is supported)")
    if role == "decode" and runner.host_pool.num_blocks == 0:
        raise ValueError("kv_role='decode' needs swap_space > 0: pulled pages wait in host "
                         "blocks until device blocks are free")
    sharding = runner.kv_cache[0].sharding if runner.placement.mesh is not None else None
    # an offered ticket nobody settles is released after twice the pull deadline
    return KVTransfer(next(iter(runner.kv_cache[0].devices())), kv_sharding=sharding,
                      max_age_s=2 * timeout_s, kv_format=runner.kv_format)


def check_request(role: str | None, params: dict | None,
                  transfer: KVTransfer | None = None) -> TransferTicket | None:
    """Validate a request's ``kv_transfer_params`` for this instance (``transfer``: its
    transfer server, whose KV-head split a ticket must match); the ticket to pull on a
    decode instance, else None."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params={params!r} must be an object")
    if params.get("do_remote_decode"):
        if role != "prefill":
            raise ValueError("kv_transfer_params.do_remote_decode needs an instance started "
                             "with kv_role='prefill'")
        return None
    if role != "decode":
        raise ValueError("kv_transfer_params with a ticket need an instance started with "
                         "kv_role='decode'")
    ticket = TransferTicket.from_dict(params)
    prompt = params.get("prompt_token_ids")
    outputs = params.get("output_token_ids")
    if (not isinstance(prompt, list) or not prompt or not isinstance(outputs, list)
            or not outputs or any(not isinstance(t, int) for t in prompt + outputs)):
        raise ValueError("kv_transfer_params need prompt_token_ids and output_token_ids "
                         "(lists of token ids)")
    if transfer is not None and ticket.kv_shards != transfer.kv_shards:
        raise ValueError(f"kv_transfer_params come from a prefill instance that splits the KV "
                         f"heads over {ticket.kv_shards} device(s), this decode instance over "
                         f"{transfer.kv_shards}: start both with the same "
                         "tensor_parallel_size")
    if transfer is not None and ticket.kv_format != transfer.kv_format:
        raise ValueError(f"kv_transfer_params come from a prefill instance whose KV cache "
                         f"holds {ticket.kv_format or 'model-dtype'} pages, this decode "
                         f"instance's {transfer.kv_format or 'model-dtype'} ones: start both "
                         "with the same kv_cache_dtype")
    return ticket


def offer_pages(transfer: KVTransfer, runner: Any, touched: list[Request]) -> None:
    """A prefill instance: offer the prompt pages of the requests among ``touched`` that
    just finished at their token limit, and put each ticket on its request. Their blocks
    were freed as they finished, but nothing has been dispatched since that could write
    into them, and the gather runs before anything dispatched later (one device, calls in
    order)."""
    for request in touched:
        if request.exported_blocks and request.kv_transfer_params is None:
            ticket = transfer.offer(runner.kv_cache, request.exported_blocks, runner.executables)
            request.kv_transfer_params = dict(
                ticket.to_dict(), prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids))


def install(engine: Any, request: Request, pages: Pages, params: dict) -> None:
    """Add ``request`` (made from the ticket's prompt ids) to ``engine`` with its prompt
    pages in host blocks and the tokens the prefill instance sampled in its output."""
    k = pages[0]  # the first cache array (K when split): its blocks and per-token shape
    if len(params["output_token_ids"]) >= request.max_tokens:
        raise ValueError(f"max_tokens={request.max_tokens} leaves nothing to decode after the "
                         f"{len(params['output_token_ids'])} token(s) the prefill instance sampled")
    block_size = engine.kv_cache_manager.block_size
    needed = engine.kv_cache_manager.num_blocks_for(request.num_prompt_tokens)
    if k.shape[1] != needed or k.shape[2] != block_size:
        raise ValueError(f"the pulled pages ({k.shape[1]} blocks of {k.shape[2]} tokens) do "
                         f"not fit a {request.num_prompt_tokens}-token prompt in blocks of "
                         f"{block_size}: the instances' block sizes differ")
    pool = engine.runner.host_pool
    host_k = pool.arrays[0]  # [host blocks, layers, block_size, ...]
    if len(pages) != len(pool.arrays):
        raise ValueError(f"the pulled pages are {len(pages)} array(s), this instance's KV "
                         f"cache {len(pool.arrays)}: the instances lay pages out differently "
                         "(a TPU's fused rows against split K and V, or an int8 cache's "
                         "per-token scale codes against another kv_cache_dtype)")
    if k.shape[0] != host_k.shape[1] or k.shape[3:] != host_k.shape[3:]:
        raise ValueError(f"the pulled pages have shape {k.shape[:1] + k.shape[3:]} per token "
                         f"(layers, then kv heads and head dim or a fused row), this model "
                         f"{host_k.shape[1:2]}{host_k.shape[3:]}: the instances serve "
                         "different models")
    if k.dtype != pool.dtype:
        raise ValueError(f"the pulled pages are {k.dtype}, this instance's KV cache "
                         f"{pool.dtype}: start both instances with the same dtype and "
                         "kv_cache_dtype")
    try:
        host = engine.kv_cache_manager.adopt_host_blocks(request, needed)
    except ValueError as error:
        raise NoRoomForPages(str(error)) from None
    for host_array, array in zip(pool.arrays, pages):
        host_array[host] = np.moveaxis(array, 1, 0).astype(pool.dtype)
    request.num_computed_tokens = request.num_prompt_tokens
    for token in params["output_token_ids"]:
        request.append_output_token(int(token))
    request.first_token_time = time.monotonic()
    try:
        engine.scheduler.add_prefilled(request)
    except ValueError:
        engine.kv_cache_manager.free(request)  # gives the host blocks back
        raise
    engine.groups.add(request)
    advance([request])  # a grammar consumes the tokens sampled on the prefill instance


class KVHandoff:
    """``LLMEngine``'s disaggregated-serving methods (mixed in); they use its ``config``,
    ``kv_transfer`` and ``groups``."""

    def check_kv_transfer(self, params: dict | None):
        """Validate ``kv_transfer_params`` for this instance's ``kv_role``; the ticket to
        pull (a decode instance), else None (``engine.features.kv_handoff``)."""
        return check_request(self.config.cache.kv_role, params, self.kv_transfer)

    def settle_kv(self, uuid: int, pulled: bool) -> bool:
        """A prefill instance: the pull of an offered ticket is over (``pulled``) or will
        never come, so its pages are released (``KVTransfer.settle``)."""
        if self.config.cache.kv_role != "prefill":
            raise ValueError("settling a KV transfer needs an instance started with "
                             "kv_role='prefill'")
        return self.kv_transfer.settle(uuid, pulled)

    def kv_transfer_stats(self) -> dict[str, int]:
        """``get_stats``' part for disaggregated serving (empty when not disaggregated).
        A prefill instance: tickets offered (each request's pages gathered into one K and
        one V array), pending and released unpulled. A decode instance: pulls made (one
        per request), the blocks they brought and the bytes they moved."""
        transfer, role = self.kv_transfer, self.config.cache.kv_role
        if transfer is None:
            return {}
        if role == "prefill":
            return {"kv_tickets_offered": transfer.num_exported,
                    "kv_tickets_pending": transfer.num_pending,
                    "kv_tickets_released": transfer.num_released}
        return {"kv_pulls": transfer.num_imported,
                "kv_pulled_blocks": transfer.num_imported_blocks,
                "kv_pulled_bytes": transfer.num_imported_bytes}

    def pull_kv(self, ticket) -> Pages:
        """A prefill instance's pages for ``ticket`` (thread-safe; TimeoutError)."""
        return self.kv_transfer.pull(ticket, self.config.cache.kv_transfer_timeout)

    def add_prefilled(self, request: Request, pages: Pages,
                      kv_transfer: dict) -> None:
        """Queue a request whose prompt a prefill instance ran, with its pulled pages."""
        if request.request_id in self.groups:
            raise ValueError(f"request_id={request.request_id!r} is already in the engine")
        install(self, request, pages, kv_transfer)
