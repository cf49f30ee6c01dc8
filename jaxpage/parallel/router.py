"""Data parallelism: M engine replicas on disjoint device groups behind one front end.

``DataParallelEngine`` offers the ``LLMEngine`` surface that ``LLM`` (and a server) use:
``make_request`` / ``add_validated_request`` / ``step`` / ``abort_request`` / stats. Each
request goes to one replica for its whole life (its KV blocks live there):

* least-loaded: the replica with the fewest unfinished sequences (waiting, running,
  swapped, plus beam searches), ties to the lowest index;
* prefix-aware, when prefix caching is on: the replica already holding, or recently
  sent, the longest run of the prompt's full blocks wins, unless it is busier than the
  least-loaded one by more than ``max_imbalance`` sequences (then load wins).

``step()`` steps every replica with work; the replicas' device calls run concurrently in
threads (their devices are disjoint; JAX releases the GIL while a program runs).
Request ids come from one counter, so ids (and unseeded sampling keyed by them) do not
depend on the replica a request lands on.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxpage.core.kv.prefix_hash import extend_block_hashes
from jaxpage.core.request import Request
from jaxpage.outputs import RequestOutput

AFFINITY_CAPACITY = 1 << 16  # block hashes remembered for routing (oldest forgotten first)


# Stats that are rates: averaged over replicas, not summed.
_AVERAGED = ("kv_usage", "prefix_cache_hit_rate", "spec_acceptance_rate",
             "spec_mean_accepted_length", "kv_bytes_per_block")


class _MergedResults:
    """Finished beam searches of every replica, read like one dict."""

    def __init__(self, engines: list) -> None:
        self._engines = engines

    def __contains__(self, key: str) -> bool:
        return any(key in e.beam_search.results for e in self._engines)

    def pop(self, key: str, *default: Any) -> Any:
        for engine in self._engines:
            if key in engine.beam_search.results:
                return engine.beam_search.results.pop(key)
        if default:
            return default[0]
        raise KeyError(key)


class _MergedBeamSearch:
    def __init__(self, engines: list) -> None:
        self.results = _MergedResults(engines)


class DataParallelEngine:
    """Routes requests over ``engines`` (LLMEngine replicas with equal configs)."""

    def __init__(self, engines: list, *, max_imbalance: int | None = None) -> None:
        if not engines:
            raise ValueError("DataParallelEngine needs at least one engine")
        self.engines = engines
        self.config = engines[0].config
        self.block_size = self.config.cache.block_size
        self.prefix_aware = self.config.cache.enable_prefix_caching
        self.max_imbalance = (max(1, self.config.scheduler.max_num_seqs // 2)
                              if max_imbalance is None else max_imbalance)
        self.beam_search = _MergedBeamSearch(engines)
        self._ids = itertools.count()
        self._owner: dict[str, int] = {}                    # request id -> replica index
        self._affinity: OrderedDict[bytes, int] = OrderedDict()  # block hash -> replica
        self._pool = ThreadPoolExecutor(len(engines), thread_name_prefix="jaxpage-dp")
        self.num_routed = [0] * len(engines)               # requests sent to each replica

    def __getattr__(self, name: str) -> Any:
        # tokenizer, arch, max_model_len, eos_token_ids, ...: equal on every replica
        return getattr(self.engines[0], name)

    # -- requests ---------------------------------------------------------------------

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def make_request(self, request_id: str, prompt: Any, params: Any,
                     priority: int = 0, grammar: Any = None, kv_transfer: Any = None) -> Request:
        return self.engines[0].make_request(request_id, prompt, params, priority, grammar,
                                            kv_transfer)

    def check_kv_transfer(self, params: Any) -> Any:
        return self.engines[0].check_kv_transfer(params)

    def compile_grammar(self, spec: Any) -> Any:
        """A structured-outputs grammar, compiled once for every replica (same tokenizer)."""
        return self.engines[0].compile_grammar(spec)

    def add_request(self, request_id: str | None, prompt: Any, params: Any,
                    priority: int = 0) -> str:
        request_id = self.next_request_id() if request_id is None else str(request_id)
        self.add_validated_request(self.make_request(request_id, prompt, params, priority))
        return request_id

    def add_validated_request(self, request: Request) -> None:
        if request.request_id in self._owner:
            raise ValueError(f"request_id={request.request_id!r} is already in the engine")
        index = self.route(request)
        self.engines[index].add_validated_request(request)
        self._assign(request, index)

    def add_beam_search(self, search_id: str, prompt: Any, params: Any) -> None:
        if search_id in self._owner:
            raise ValueError(f"request_id={search_id!r} is already in the engine")
        index = self._least_loaded()
        self.engines[index].add_beam_search(search_id, prompt, params)
        self._owner[search_id] = index
        self.num_routed[index] += 1

    def abort_request(self, request_id: str) -> None:
        index = self._owner.pop(request_id, None)
        if index is not None:
            self.engines[index].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    # -- routing ----------------------------------------------------------------------

    def load(self, index: int) -> int:
        """Unfinished sequences on replica ``index`` (beam searches count their beams)."""
        stats = self.engines[index].scheduler.stats()
        return stats["num_running"] + stats["num_waiting"] + stats["num_swapped"]

    def _least_loaded(self) -> int:
        loads = [self.load(i) for i in range(len(self.engines))]
        return loads.index(min(loads))

    def cached_blocks(self, index: int, hashes: list[bytes]) -> int:
        """Leading full blocks of ``hashes`` cached on, or recently routed to, replica ``index``."""
        pool = self.engines[index].block_pool
        count = 0
        for block_hash in hashes:
            if pool.get_cached_block(block_hash) is None and self._affinity.get(block_hash) != index:
                break
            count += 1
        return count

    def route(self, request: Request) -> int:
        """The replica for ``request`` (see the module docstring for the rule)."""
        least = self._least_loaded()
        if not self.prefix_aware or len(self.engines) == 1:
            return least
        hashes = self._hashes(request)
        if not hashes:
            return least
        hits = [self.cached_blocks(i, hashes) for i in range(len(self.engines))]
        best = max(range(len(self.engines)), key=lambda i: (hits[i], -self.load(i), -i))
        if hits[best] == 0 or self.load(best) - self.load(least) > self.max_imbalance:
            return least
        return best

    def _hashes(self, request: Request) -> list[bytes]:
        hashes: list[bytes] = []
        extend_block_hashes(hashes, request.prompt_token_ids, self.block_size,
                            request.extra_keys)
        return hashes

    def _assign(self, request: Request, index: int) -> None:
        self._owner[request.request_id] = index
        self.num_routed[index] += 1
        if self.prefix_aware:
            for block_hash in self._hashes(request):
                self._affinity[block_hash] = index
                self._affinity.move_to_end(block_hash)
            while len(self._affinity) > AFFINITY_CAPACITY:
                self._affinity.popitem(last=False)

    # -- one iteration ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Step every replica that has work (concurrently); finished outputs of all."""
        busy = [e for e in self.engines if e.has_unfinished_requests()]
        if len(busy) <= 1:
            results = [e.step() for e in busy]
        else:
            results = list(self._pool.map(lambda e: e.step(), busy))
        outputs = [out for result in results for out in result]
        for out in outputs:
            self._owner.pop(out.request_id, None)
        return outputs

    # -- introspection ----------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """Sums over replicas (rates averaged; settings such as ``quantization``, the same on
        every replica, as replica 0's), plus per-replica routing counts."""
        per_replica = [e.get_stats() for e in self.engines]
        total: dict[str, Any] = {}
        for key in per_replica[0]:
            values = [stats[key] for stats in per_replica]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                total[key] = values[0]
            else:
                total[key] = (sum(values) / len(values) if key in _AVERAGED else sum(values))
        total["num_routed"] = list(self.num_routed)
        return total

    def num_used_blocks(self) -> int:
        return sum(e.num_used_blocks() for e in self.engines)

    def warmup(self) -> int:
        return sum(e.warmup() for e in self.engines)
