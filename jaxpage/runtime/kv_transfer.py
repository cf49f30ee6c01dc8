"""Moving a request's KV pages between processes with JAX's transfer server
(``jax.experimental.transfer``), for disaggregated prefill and decode.

* The sending side (a prefill instance) gathers the request's blocks into one array per
  cache array (``block_ops.gather_blocks``: K and V ``[layers, P, block_size, kv_heads,
  head_dim]`` in the split layout, one ``[layers, P, block_size, W]`` in the fused one of
  TPUs, ``pallas_kernels.kv_layout``; P the block count padded to a power of two) and
  offers them under a fresh id
  (``await_pull``): one transfer per request, never one per block. The gathered copy is
  the transfer server's from then on; the request's KV blocks are free at once.
* The receiving side (a decode instance) pulls that id into arrays of the same shape
  (``pull``, with a deadline: a prefill instance that died cannot hang it) and hands them
  to the engine, which installs them as a swapped-out request's host blocks.

Only the handshake (``TransferTicket``: address, id, shape, dtype) travels as JSON; the
pages never do. The server listens on explicit loopback or host addresses (jax 0.10's
default addresses abort).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import asdict, dataclass

import jax
import numpy as np

from jaxpage.runtime.block_ops import gather_blocks, padded, run_program


@dataclass(frozen=True)
class TransferTicket:
    """What a decode instance needs to pull one request's pages (JSON-safe)."""

    address: str           # the sending transfer server
    uuid: int              # the transfer's id there
    shape: tuple[int, ...]  # of each array: [layers, P, block_size, kv_heads, head_dim]
    dtype: str             # (split: K and V), or [layers, P, block_size, W] (fused: one)
    num_blocks: int        # real blocks among the P
    kv_shards: int = 1     # devices the sender splits the KV heads over (tensor parallelism)
    num_arrays: int = 2    # 2: split K and V; 1: fused rows (kv_layout); 4: split K and V,
    #                        then their per-token scale codes (int8, kv_token_scale), each
    #                        ``shape`` without its head dim
    kv_format: str | None = None  # how the bytes of a byte cache read (kv_quant): uint8
    #                        pages of "int8", "fp8_e4m3" and "fp8_e5m2" look alike

    def to_dict(self) -> dict:
        return dict(asdict(self), shape=list(self.shape))

    @classmethod
    def from_dict(cls, data: dict) -> "TransferTicket":
        try:
            ticket = cls(address=str(data["address"]), uuid=int(data["uuid"]),
                         shape=tuple(int(x) for x in data["shape"]), dtype=str(data["dtype"]),
                         num_blocks=int(data["num_blocks"]),
                         kv_shards=int(data.get("kv_shards", 1)),
                         num_arrays=int(data.get("num_arrays", 2)),
                         kv_format=data.get("kv_format"))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"kv_transfer_params={data!r} is not a KV transfer ticket "
                             f"({error})") from None
        if (ticket.num_arrays not in (1, 2, 4)
                or len(ticket.shape) != 3 + min(ticket.num_arrays, 2)
                or not 0 < ticket.num_blocks <= ticket.shape[1]
                or ticket.kv_shards < 1
                or not (ticket.kv_format is None or isinstance(ticket.kv_format, str))):
            raise ValueError(f"kv_transfer_params={data!r} has an invalid shape, block count, "
                             "shard count or byte format")
        return ticket


class KVTransfer:
    """One process's transfer server: offers gathered pages and pulls others' pages.

    ``kv_sharding``: the KV cache's sharding under tensor parallelism (KV heads split over
    the mesh axis). Gathered pages keep it, and pulls ask for it, so the pages move shard
    by shard, each device's KV heads to the device holding the same heads on the other
    side; both sides must split the heads over the same number of devices."""

    def __init__(self, device: jax.Device, host: str = "127.0.0.1",
                 kv_sharding: jax.sharding.Sharding | None = None,
                 max_age_s: float = 60.0, kv_format: str | None = None) -> None:
        from jax.experimental import transfer

        self.device = device
        self.sharding = kv_sharding or jax.sharding.SingleDeviceSharding(device)
        self.kv_shards = len(self.sharding.device_set)
        self.kv_format = kv_format  # the cache's byte format (None: model-dtype pages)
        self.server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])
        self.address = self.server.address()
        # Ids unique across processes that may offer to the same puller.
        self._ids = itertools.count(int.from_bytes(os.urandom(6), "little") << 16)
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()
        # Offered tickets not yet settled: uuid -> (ticket, when offered). The server holds
        # their gathered pages until they are pulled; ``settle`` / ``expire`` end them.
        self._offered: dict[int, tuple[TransferTicket, float]] = {}
        self.max_age_s = max_age_s
        # Counters (read by ``LLMEngine.get_stats``): tickets offered here; pulls this
        # process made (one per request: its pages as one K and one V array), the real
        # blocks they brought and the bytes they moved (K and V, padded block count).
        self.num_exported = 0
        self.num_imported = 0
        self.num_imported_blocks = 0
        self.num_imported_bytes = 0
        self.num_released = 0
        self._releases: list[threading.Thread] = []  # self-pulls freeing released pages

    def offer(self, kv_cache, block_ids: list[int], programs=None) -> TransferTicket:
        """Gather ``block_ids`` of ``kv_cache`` and offer them for one pull (tickets older
        than ``max_age_s`` that nobody settled are released first)."""
        self.expire(self.max_age_s)
        pages = run_program(programs, gather_blocks, kv_cache,
                            jax.device_put(padded(block_ids)))
        uuid = next(self._ids)
        self.server.await_pull(uuid, pages)
        self.num_exported += 1
        ticket = TransferTicket(self.address, uuid, tuple(pages[0].shape), str(pages[0].dtype),
                                len(block_ids), self.kv_shards, len(pages), self.kv_format)
        with self._lock:
            self._offered[uuid] = (ticket, time.monotonic())
        return ticket

    @property
    def num_pending(self) -> int:
        """Offered tickets not settled yet (their pages held by the transfer server)."""
        return len(self._offered)

    def settle(self, uuid: int, pulled: bool) -> bool:
        """End offered ticket ``uuid``: it was pulled, or (``pulled=False``) it never will
        be (the decode instance refused the request, or it never got there), and its
        gathered pages are released. False for an id not offered here or already settled.
        """
        with self._lock:
            entry = self._offered.pop(uuid, None)
        if entry is None:
            return False
        if not pulled:
            self._release(entry[0])
        return True

    def expire(self, max_age_s: float) -> int:
        """Release the pages of tickets offered more than ``max_age_s`` ago and never
        settled (a proxy that died, a message lost); the number released."""
        now = time.monotonic()
        with self._lock:
            stale = [uuid for uuid, (_, at) in self._offered.items() if now - at > max_age_s]
        return sum(self.settle(uuid, pulled=False) for uuid in stale)

    def _release(self, ticket: TransferTicket) -> None:
        """Free a ticket's pages. jax 0.10's ``await_pull`` cannot be cancelled, so this
        process pulls them itself and drops them (on a daemon thread: were they already
        pulled elsewhere after all, that pull would wait for ever, but never us)."""
        connection = self._connection(self.address)
        specs = self._specs(ticket)
        worker = threading.Thread(target=lambda: connection.pull(ticket.uuid, specs),
                                  name=f"kv-release-{ticket.uuid}", daemon=True)
        worker.start()
        with self._lock:
            self._releases = [t for t in self._releases if t.is_alive()] + [worker]
        self.num_released += 1

    def wait_for_releases(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the release pulls started so far; the number still
        running (0: every released ticket's pages are gone from the transfer server, so a
        late puller of one gets nothing). Until then a late pull may still race the
        release for the pages."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            workers = list(self._releases)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        return sum(worker.is_alive() for worker in workers)

    def _connection(self, address: str):
        with self._lock:
            connection = self._connections.get(address)
            if connection is None:
                connection = self._connections[address] = self.server.connect(address)
            return connection

    def _specs(self, ticket: TransferTicket) -> tuple:
        spec = jax.ShapeDtypeStruct(ticket.shape, np.dtype(ticket.dtype), sharding=self.sharding)
        if ticket.num_arrays == 4:  # K, V, then their scale codes [layers, P, block_size, heads]
            codes = jax.ShapeDtypeStruct(ticket.shape[:-1], np.dtype(ticket.dtype),
                                         sharding=self.sharding)
            return (spec, spec, codes, codes)
        return (spec,) * ticket.num_arrays

    def pull(self, ticket: TransferTicket, timeout_s: float) -> tuple[np.ndarray, ...]:
        """The pages of ``ticket`` on the host, one ``[layers, num_blocks, ...]`` per
        cache array (K and V, or the fused rows). Raises ``TimeoutError`` when they do
        not arrive within ``timeout_s``."""
        connection = self._connection(ticket.address)
        if ticket.kv_shards != self.kv_shards:
            raise ValueError(f"the prefill instance splits the KV heads over {ticket.kv_shards} "
                             f"device(s), this decode instance over {self.kv_shards}: start "
                             "both with the same tensor_parallel_size")
        specs = self._specs(ticket)
        result: list = []

        def pull() -> None:
            try:
                pages = connection.pull(ticket.uuid, specs)
                result.append(tuple(np.asarray(array) for array in pages))
            except Exception as error:  # noqa: BLE001 - reported below
                result.append(error)

        # jax 0.10's pull blocks until the pages arrive and ignores its own timeout, so it
        # runs on a daemon thread: a sender that died leaves that thread waiting, never us.
        worker = threading.Thread(target=pull, name=f"kv-pull-{ticket.uuid}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if not result or isinstance(result[0], Exception):
            reason = result[0] if result else f"nothing arrived in {timeout_s:.0f} s"
            raise TimeoutError(f"KV transfer {ticket.uuid} from {ticket.address} failed: "
                               f"{reason}")
        pages = result[0]
        with self._lock:  # pulls run on several pool threads at once
            self.num_imported += 1
            self.num_imported_blocks += ticket.num_blocks
            self.num_imported_bytes += sum(array.nbytes for array in pages)
        return tuple(array[:, :ticket.num_blocks] for array in pages)
