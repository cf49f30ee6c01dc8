"""The data-parallel router's choices, on stand-in replicas (no devices)."""

from types import SimpleNamespace

from jaxpage.config import EngineConfig
from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.request import Request
from jaxpage.parallel.router import DataParallelEngine
from jaxpage.sampling_params import SamplingParams


class FakeReplica:
    def __init__(self, config):
        self.config = config
        self.block_pool = BlockPool(64, enable_caching=config.cache.enable_prefix_caching)
        self.queued = []
        self.beam_search = SimpleNamespace(results={})

    @property
    def scheduler(self):
        return SimpleNamespace(stats=lambda: {"num_running": 0, "num_waiting": len(self.queued),
                                              "num_swapped": 0})

    def add_validated_request(self, request):
        self.queued.append(request)


def request(i, ids):
    return Request(str(i), ids, SamplingParams(max_tokens=1), max_model_len=128)


def make(caching=True, max_num_seqs=8):
    config = EngineConfig.from_kwargs(block_size=4, enable_prefix_caching=caching,
                                      max_num_seqs=max_num_seqs, max_num_batched_tokens=16)
    return DataParallelEngine([FakeReplica(config), FakeReplica(config)])


def test_least_loaded_alternates_without_prefix_caching():
    router = make(caching=False)
    for i in range(6):
        router.add_validated_request(request(i, [1, 2, 3, 4, 5]))
    assert router.num_routed == [3, 3]


def test_shared_prefix_follows_its_replica_until_the_imbalance_limit():
    router = make(max_num_seqs=8)  # max_imbalance = 4
    shared = list(range(100, 112))  # three full blocks
    owners = []
    for i in range(7):
        router.add_validated_request(request(i, shared + [i]))
        owners.append(router._owner[str(i)])
    # the first five go together (load difference 0..4); the sixth would make it 5
    assert owners[:5] == [0] * 5 and owners[5] == 1
    unrelated = request(99, [7, 7, 7, 7, 7])
    assert router.route(unrelated) == 1  # least loaded


def test_blocks_cached_on_a_replica_attract_the_prompt():
    router = make()
    shared = list(range(200, 208))
    hashes = router._hashes(request(0, shared + [1]))
    pool = router.engines[1].block_pool
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, hashes[0])
    assert router.cached_blocks(1, hashes) == 1 and router.cached_blocks(0, hashes) == 0
    assert router.route(request(1, shared + [1])) == 1


def test_stats_sum_counts_and_keep_settings():
    router = make()
    for i, replica in enumerate(router.engines):
        replica.get_stats = (lambda i=i: {"num_kv_blocks": 10 + i, "quantization": None,
                                          "kv_cache_dtype": "int8", "kv_usage": 0.5 * i,
                                          "kv_bytes_per_block": 64, "weight_bytes": 100})
    stats = router.get_stats()
    assert stats["num_kv_blocks"] == 21 and stats["weight_bytes"] == 200
    assert stats["quantization"] is None and stats["kv_cache_dtype"] == "int8"
    assert stats["kv_usage"] == 0.25 and stats["kv_bytes_per_block"] == 64
