"""Backend choice, static tiling choices, and that the kernels lower for the real chips.

The lowering tests build the programs a GPU (Triton) and a TPU (Mosaic) would compile,
from this CPU: every Pallas lowering rule runs and Triton's own op verifiers check the
shapes. What comes after (Triton -> PTX, Mosaic's layout passes in libtpu) needs the
device and is not checked here.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.kv_cache_update import kv_cache_update
from pallas_kernels.kv_cache_update import resolve_backend as resolve_kv_backend
from pallas_kernels.kv_cache_update.gpu import kv_cache_update_gpu
from pallas_kernels.kv_cache_update.tpu import kv_cache_update_tpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, resolve_backend
from pallas_kernels.ragged_paged_attention import gpu, gpu_config, tpu
from tests.kernels.cases import make_case


def test_auto_picks_the_platform_kernel_and_the_reference_on_cpu():
    assert jax.default_backend() == "cpu"
    assert resolve_backend("auto") == "cpu"  # the C++ kernel (a compiler is on the machine)
    assert _backend.resolve("auto", platform="gpu") == "gpu"
    assert _backend.resolve("auto", platform="cuda") == "gpu"
    assert _backend.resolve("auto", platform="tpu") == "tpu"
    assert _backend.resolve("auto", platform="cpu") == "reference"
    # The KV update keeps the XLA scatter under "auto" everywhere (see its module doc).
    assert resolve_kv_backend("auto") == "reference"
    assert _backend.resolve("auto", platform="gpu", auto="reference") == "reference"


def test_inline_ptx_only_for_nvidia_gpus():
    """The GPU kernels' inline PTX is for NVIDIA's GPUs: a ROCm client (by its platform
    version) and other platforms get the plain conversions."""
    from types import SimpleNamespace

    def device(platform, version):
        return SimpleNamespace(platform=platform,
                               client=SimpleNamespace(platform_version=version))

    assert _backend.runs_ptx(device("gpu", "PJRT C API\nNVIDIA H100 80GB HBM3"))
    assert _backend.runs_ptx(device("gpu", "cuda 12080"))
    assert not _backend.runs_ptx(device("gpu", "rocm 60342134"))
    assert not _backend.runs_ptx(device("rocm", ""))
    assert not _backend.runs_ptx(device("cpu", "cpu"))
    assert not _backend.runs_ptx(device("tpu", "TFRT TPU v5 lite"))


def test_compiled_kernel_on_the_wrong_platform_raises_and_interpret_runs_it():
    case = make_case(np.random.default_rng(0), [2], [5])
    args = case.args(poisoned=False)
    for backend in ("gpu", "tpu"):
        with pytest.raises(ValueError, match="interpret=True"):
            ragged_paged_attention(*args, sm_scale=1.0, backend=backend)
        with pytest.raises(ValueError, match="interpret=True"):
            kv_cache_update(args[1], args[2], args[1][0, :2], args[2][0, :2],
                            jnp.array([0, -1], jnp.int32), backend=backend)
        assert resolve_backend(backend, interpret=True) == backend
    with pytest.raises(ValueError, match="backend='triton'"):
        resolve_backend("triton")


def test_gpu_tiling_for_llama3_8b_decode():
    """Batch 64 decode, 32 q / 8 kv heads, 2048 context, block 16: one token per tile,
    the 4 query heads of a group padded into 16 rows, 64 KV tokens per step, and a 2-way
    KV split so the grid has ~1024 programs."""
    block_q, group_padded, pages, splits = gpu_config.choose_blocks(
        num_tokens=64, max_num_seqs=64, group=4, block_size=16, max_blocks_per_seq=128,
        num_kv_heads=8)
    assert (block_q * group_padded, pages * 16, splits) == (16, 64, 2)
    # Few sequences: split further so short batches still fill the chip.
    *_, splits = gpu_config.choose_blocks(num_tokens=4, max_num_seqs=4, group=4, block_size=16,
                                   max_blocks_per_seq=128, num_kv_heads=8)
    assert splits == 32
    # Splits need not be a power of two: 48 sequences x 8 KV heads are 384 programs, and
    # 3 splits (1,152 programs) are the fewest that reach the 1,024 targeted.
    *_, splits = gpu_config.choose_blocks(num_tokens=48, max_num_seqs=48, group=4, block_size=16,
                                   max_blocks_per_seq=128, num_kv_heads=8)
    assert splits == 3
    # Prefill-shaped batches: bigger query tiles, no split.
    block_q, group_padded, _, splits = gpu_config.choose_blocks(
        num_tokens=2048, max_num_seqs=8, group=3, block_size=16, max_blocks_per_seq=128,
        num_kv_heads=3)
    assert (block_q, group_padded, splits) == (16, 4, 1)


def _attention_args(num_tokens, max_num_seqs, num_q_heads, num_kv_heads, head_dim,
                    block_size, num_blocks, max_blocks, dtype):
    sds = jax.ShapeDtypeStruct
    cache = sds((num_blocks, block_size, num_kv_heads, head_dim), dtype)
    return (sds((num_tokens, num_q_heads, head_dim), dtype), cache, cache,
            sds((max_num_seqs,), jnp.int32), sds((max_num_seqs, max_blocks), jnp.int32),
            sds((max_num_seqs + 1,), jnp.int32), sds((1,), jnp.int32))


SHAPES = [  # (T, S, Hq, Hkv, D, B, N, M, dtype, options)
    (64, 64, 32, 8, 128, 16, 4096, 128, jnp.bfloat16, {}),
    (512, 8, 32, 8, 128, 16, 4096, 64, jnp.bfloat16, dict(sliding_window=128, soft_cap=30.0)),
    (7, 4, 9, 3, 64, 16, 100, 8, jnp.float32, {}),
]


@pytest.fixture
def pretend_tpu(monkeypatch):
    """Mosaic's lowering asks the default device for its TPU generation; answer v5e."""
    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError:  # pragma: no cover - private module moved
        pytest.skip("jax._src.pallas.mosaic.tpu_info not found in this JAX")
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)


def _lower(fn, args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("shape", SHAPES, ids=["decode_llama3", "prefill_window_cap", "gqa3_f32"])
def test_attention_lowers_to_triton_for_cuda(shape):
    *dims, options = shape
    text = _lower(lambda *a: gpu.ragged_paged_attention_gpu(*a, sm_scale=0.1, **options),
                  _attention_args(*dims), "cuda")
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("shape", SHAPES, ids=["decode_llama3", "prefill_window_cap", "gqa3_f32"])
def test_attention_lowers_to_mosaic_for_tpu(shape, pretend_tpu):
    *dims, options = shape
    text = _lower(lambda *a: tpu.ragged_paged_attention_tpu(*a, sm_scale=0.1, **options),
                  _attention_args(*dims), "tpu")
    assert "tpu_custom_call" in text


def test_kv_cache_update_lowers_for_cuda_and_tpu(pretend_tpu):
    sds = jax.ShapeDtypeStruct
    cache = sds((1024, 16, 8, 128), jnp.bfloat16)
    new = sds((64, 8, 128), jnp.bfloat16)
    args = (cache, cache, new, new, sds((64,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in _lower(kv_cache_update_gpu, args, "cuda")
    assert "tpu_custom_call" in _lower(kv_cache_update_tpu, args, "tpu")


def test_auto_on_a_gpu_falls_back_to_the_reference_for_shapes_triton_cannot_tile(monkeypatch):
    case = make_case(np.random.default_rng(1), [1, 2], [5, 7], head_dim=48)
    want = ragged_paged_attention(*case.args(poisoned=False), sm_scale=0.2, backend="reference")
    monkeypatch.setattr(_backend, "platform_backend", lambda platform=None: "gpu")
    assert resolve_backend("auto") == "gpu"
    got = ragged_paged_attention(*case.args(poisoned=False), sm_scale=0.2, backend="auto")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        ragged_paged_attention(*case.args(poisoned=False), sm_scale=0.2, backend="gpu",
                               interpret=True)
