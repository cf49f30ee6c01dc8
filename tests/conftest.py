"""Shared fixtures: the embedded model path, its tokenizer, tiny checkpoints, compile cache."""

from __future__ import annotations

import os

import pytest

# The suite runs on the CPU; TPU and GPU programs are compiled for targets described in
# software (tests/compile), never for a local device. Set before JAX is imported, so the
# installed libtpu and CUDA plugin are not initialized as local backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# Engines build their programs when a batch first needs them, not the CPU default's core
# warm-up at construction: the suite builds hundreds of engines of many shapes, and each
# test compiles only what it runs. tests/engine/test_core_warmup.py asks for it explicitly.
os.environ.setdefault("JAXPAGE_WARMUP", "none")


def pytest_configure(config):
    # One persistent XLA cache for the whole suite (and across runs on the same machine).
    import jax

    cache = os.environ.get("JAXPAGE_TEST_XLA_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "jaxpage", "xla-tests"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from jaxpage.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(request):
    """SmolLM2's tokenizer, from the embedded GGUF, or from the Hugging Face tokenizer
    directory ``JAXPAGE_TEST_TOKENIZER`` names (a lent GPU machine, where the 98 MB GGUF
    package cannot travel: ``scripts/accelerator_check.sh``)."""
    from jaxpage.engine.tokenizer import load_tokenizer

    directory = os.environ.get("JAXPAGE_TEST_TOKENIZER")
    if directory:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    return load_tokenizer(request.getfixturevalue("smollm2_path"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, smollm2_tokenizer) -> dict[str, str]:
    """Random tiny Llama / Qwen2 / Mistral checkpoints (Llama saved in sharded form)."""
    from tests.reference import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_checkpoint("llama", str(root / "llama"), smollm2_tokenizer, seed=1,
                                      max_shard_size="2MB"),
        "qwen2": make_tiny_checkpoint("qwen2", str(root / "qwen2"), smollm2_tokenizer, seed=2,
                                      tie_word_embeddings=True),
        "mistral": make_tiny_checkpoint("mistral", str(root / "mistral"), smollm2_tokenizer,
                                        seed=3),
    }


def assert_all_blocks_free(llm) -> None:
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


# Every LLM built during the suite is checked after every test: no KV block may leak.
_LLMS = None  # a weakref.WeakSet of every LLM, set at session start


@pytest.fixture(autouse=True)
def _all_kv_blocks_free_after_each_test():
    yield
    for llm in list(_LLMS or ()):
        assert_all_blocks_free(llm)


# Memory maps the process may hold before compiled programs are let go (below).
MAX_MAPS_KEPT = 30_000


def _num_memory_maps() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: nothing to measure
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """XLA:CPU maps each compiled program's code into memory, and the process-wide table
    of shared programs (``runtime.executable_cache``) kept every program of the suite: the
    suite ran out of memory maps (``vm.max_map_count``, 65,530 here) and crashed inside a
    compile. After a test module that leaves the process above ``MAX_MAPS_KEPT`` maps
    (one module adds at most ~17k), programs no live engine holds are let go, and a later
    module recompiles what it needs (mostly from the persistent XLA cache)."""
    yield
    if _num_memory_maps() < MAX_MAPS_KEPT:
        return
    import gc

    import jax

    from jaxpage.runtime import executable_cache

    executable_cache._SHARED_PROGRAMS.clear()
    jax.clear_caches()
    gc.collect()


def _track_llm_instances() -> None:
    global _LLMS
    import weakref

    from jaxpage.engine import llm as llm_module

    _LLMS = weakref.WeakSet()
    original_init = llm_module.LLM.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _LLMS.add(self)

    llm_module.LLM.__init__ = tracking_init


def _check_fast_paths() -> None:
    """The host loop's shortcuts for steady decoding (``AheadOfHost.schedule_ahead``'s and
    ``BatchBuilder.build``'s) are checked against the paths they shortcut at every step
    of the suite."""
    from jaxpage.core.batch.builder import BatchBuilder
    from jaxpage.core.sched.ahead_of_host import AheadOfHost

    AheadOfHost.check_fast_paths = True
    BatchBuilder.check_fast_paths = True


def pytest_sessionstart(session):
    _track_llm_instances()
    _check_fast_paths()
