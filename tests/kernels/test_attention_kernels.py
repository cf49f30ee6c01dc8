"""Pallas ragged paged attention (GPU and TPU variants, interpret mode) vs the reference.

Every run feeds the kernel a cache whose unowned slots are NaN and q padding rows that
are NaN (see ``cases.py``); interpret mode itself fills kernel outputs and scratch with
NaN before the kernel runs (``test_interpret_mode_poisons_outputs`` pins that), so a row
a kernel forgets to write, or a junk page it lets through, shows up as NaN, and NaN
never passes: outputs are checked finite before they are compared.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from tests.default_suite import crossed, every_nth
from tests.kernels.cases import make_case, random_lens, tolerance
from tests.kernels.mode import BACKENDS, INTERPRET, interpret_only, require_backend

BF16 = jnp.bfloat16


def run_and_compare(case, backend, *, sm_scale=0.125, sliding_window=None, soft_cap=None,
                    kernel=None, **kernel_kwargs):
    require_backend(backend)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    want = np.asarray(ragged_paged_attention(*case.args(poisoned=False), backend="reference",
                                             **kw)).astype(np.float32)
    if kernel is None:
        got = ragged_paged_attention(*case.args(poisoned=True), backend=backend,
                                     interpret=INTERPRET, **kw)
    else:
        got = kernel(*case.args(poisoned=True), interpret=INTERPRET, **kw, **kernel_kwargs)
    got = np.asarray(got).astype(np.float32)
    assert got.shape == case.q.shape and got.dtype == np.float32
    assert np.isfinite(want).all()
    bad_rows = np.unique(np.argwhere(~np.isfinite(got))[:, 0])
    assert bad_rows.size == 0, f"non-finite output rows: {bad_rows}"
    n = case.num_real_tokens
    np.testing.assert_allclose(got[:n], want[:n], **tolerance(case.q.dtype))
    assert (got[n:] == 0).all(), "padding token rows must come back zero"


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# One case per feature of the matrix; each runs on both kernels (in the default
# suite on one of them, in turn).
FAST_CASES = {
    # name: (q_lens, kv_lens, options)
    "decode_only_gqa4_d128": ([1, 1, 1, 1], [9, 23, 4, 16], dict(num_q_heads=8, num_kv_heads=2,
                                                                head_dim=128)),
    "prefill_only_mha": ([7, 12], [7, 12], dict(num_q_heads=2, num_kv_heads=2)),
    "mixed_gqa8": ([1, 6, 0, 3, 1], [13, 6, 5, 11, 30], dict(num_q_heads=8, num_kv_heads=1)),
    "chunked_prefill_on_block_boundaries": ([4, 1, 8], [8, 12, 16], dict(block_size=4)),
    "gqa3_block16_bf16": ([1, 5, 2], [17, 5, 40], dict(num_q_heads=6, num_kv_heads=2,
                                                       block_size=16, dtype=BF16)),
    "decode_bf16_d128_gqa8": ([1, 1, 1], [33, 2, 64], dict(num_q_heads=8, num_kv_heads=1,
                                                           head_dim=128, block_size=8,
                                                           dtype=BF16)),
    "many_padding_seqs_and_tokens": ([2, 1], [5, 3], dict(pad_seqs=5, pad_tokens=9)),
}


@pytest.mark.parametrize("name,backend", crossed(list(FAST_CASES), BACKENDS))
def test_kernel_matches_reference(name, backend):
    q_lens, kv_lens, options = FAST_CASES[name]
    run_and_compare(make_case(rng_for(name), q_lens, kv_lens, **options), backend)


@pytest.mark.parametrize("sliding_window,soft_cap,dtype,backend", crossed(
    [(5, None, np.float32), (None, 3.0, np.float32), (4, 2.0, BF16)], BACKENDS))
def test_sliding_window_and_soft_cap(backend, sliding_window, soft_cap, dtype):
    case = make_case(rng_for(sliding_window, soft_cap), [1, 9, 1], [21, 9, 6], num_q_heads=4,
                     num_kv_heads=1, dtype=dtype)
    run_and_compare(case, backend, sm_scale=0.3, sliding_window=sliding_window,
                    soft_cap=soft_cap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sequences_gives_zeros(backend):
    case = make_case(rng_for("empty"), [], [], pad_seqs=3, pad_tokens=4)
    got = ragged_paged_attention(*case.args(poisoned=True), sm_scale=1.0, backend=backend,
                                 interpret=INTERPRET)
    assert (np.asarray(got) == 0).all()


@pytest.mark.parametrize("splits", every_nth([3, 2, 4], 2))
def test_gpu_kv_splits_match_reference(splits):
    """Flash decoding: the KV range split across programs, partials merged after."""
    case = make_case(rng_for("splits", splits), [1, 1, 3, 1], [37, 5, 29, 64],
                     num_q_heads=4, num_kv_heads=2)
    run_and_compare(case, "gpu", kernel=ragged_paged_attention_gpu, block_kv=16,
                    num_kv_splits=splits)
    run_and_compare(case, "gpu", kernel=ragged_paged_attention_gpu, block_kv=16,
                    num_kv_splits=splits, sliding_window=7)


# Tunings the GPU kernel's table can hold (``gpu_config.GpuKernelConfig``): the grid's
# order, KV tokens a step, warps, stages, the split target, q / output read and written
# in place or tiled by XLA, the unmasked loop over whole blocks, the next block's pages
# loaded a step ahead: none changes a result.
GPU_TUNINGS = {
    "heads_fastest_split": dict(heads_fastest=True, block_kv=16, target_programs=4096),
    "kv128_w8_s3": dict(block_kv=128, num_warps=8, num_stages=3),
    "heads_fastest_q32": dict(heads_fastest=True, block_q=32, block_kv=32, num_stages=4),
    "tiled_io_split": dict(direct_io=False, block_kv=16, target_programs=4096),
    "tiled_io_masked": dict(direct_io=False, mask_split=False, block_kv=32),
    "masked_only_split": dict(mask_split=False, block_kv=16, target_programs=4096),
    "prefetch_split": dict(prefetch=True, num_stages=1, block_kv=16, target_programs=4096),
    "prefetch_tiled_io": dict(prefetch=True, direct_io=False, block_kv=32),
}


@pytest.mark.parametrize("tuning", every_nth(list(GPU_TUNINGS), 3))  # 3 of 8 by default
def test_gpu_tunings_match_reference(tuning):
    """Decode, prefill chunks and padding in one batch, each tuning (interpret mode)."""
    case = make_case(rng_for("tuning", tuning), [1, 9, 1, 4], [40, 9, 70, 21],
                     num_q_heads=8, num_kv_heads=2, pad_seqs=2, pad_tokens=3)
    run_and_compare(case, "gpu", kernel=ragged_paged_attention_gpu, **GPU_TUNINGS[tuning])
    run_and_compare(case, "gpu", kernel=ragged_paged_attention_gpu, sliding_window=11,
                    **GPU_TUNINGS[tuning])


@pytest.mark.parametrize("direct_io", [True, False])
def test_gpu_tile_order_changes_no_result(direct_io):
    """``longest_first`` only changes which program takes which tile: the outputs in
    either order are the same bits, with q / output read in place or tiled by XLA (whose
    token -> tile map the reversal rewrites), and they match the reference; a padding
    sequence slot and padding tokens leave unused tiles, which move to the grid's front."""
    case = make_case(rng_for("tile_order", direct_io), [1, 13, 0, 6, 1], [40, 13, 5, 70, 21],
                     num_q_heads=4, num_kv_heads=2, pad_seqs=2, pad_tokens=3)
    kw = dict(kernel=ragged_paged_attention_gpu, block_q=4, block_kv=16,
              direct_io=direct_io, target_programs=1)
    run_and_compare(case, "gpu", longest_first=True, **kw)
    outs = [np.asarray(ragged_paged_attention_gpu(
        *case.args(poisoned=True), interpret=INTERPRET, sm_scale=0.125, block_q=4,
        block_kv=16, direct_io=direct_io, target_programs=1, longest_first=order))
        for order in (False, True)]
    np.testing.assert_array_equal(outs[0], outs[1])


def test_gpu_tuning_table_is_read(tmp_path, monkeypatch):
    """``JAXPAGE_GPU_ATTENTION_TUNING`` entries apply to their device, phase and KV bytes;
    the last match wins; shared memory caps what they ask for; bad entries are refused."""
    import json

    from pallas_kernels.ragged_paged_attention import gpu_config

    monkeypatch.setattr(gpu_config, "TUNED_FILE", tmp_path / "none.json")  # no committed table
    gpu_config._table.cache_clear()
    table = tmp_path / "tuning.json"
    table.write_text(json.dumps({"entries": [
        {"device": "H100", "phase": "decode", "kv_bytes": 2, "config": {"block_kv": 128}},
        {"device": "H100", "phase": "decode", "kv_bytes": 2,
         "config": {"block_kv": 256, "num_stages": 4, "heads_fastest": True}},
        {"device": "", "phase": "prefill", "config": {"num_warps": 8}}]}))
    monkeypatch.setenv(gpu_config.ENV_TUNING, str(table))
    kw = dict(kv_itemsize=2, compute_itemsize=2, head_dim=128, block_size=16)
    h100 = gpu_config.config_for(decode=True, kind="NVIDIA H100 80GB HBM3", **kw)
    # 256 keys x 128 x 2 bytes x (K, V) = 128 KiB a stage: one stage fits, not four
    assert (h100.block_kv, h100.num_stages, h100.heads_fastest) == (256, 1, True)
    a100 = gpu_config.config_for(decode=True, kind="NVIDIA A100-SXM4-80GB", **kw)
    assert a100 == gpu_config.DEFAULTS["decode"]
    assert gpu_config.config_for(decode=False, kind="NVIDIA A100-SXM4-80GB",
                                 **kw).num_warps == 8
    # float32 head_dim 256: the tiling that overflowed an H100's shared memory is capped
    wide = gpu_config.config_for(decode=False, kind="NVIDIA H100 80GB HBM3", kv_itemsize=4,
                                 compute_itemsize=4, head_dim=256, block_size=16)
    assert 2 * wide.num_stages * wide.block_kv * 256 * 4 + 64 * 256 * 4 <= 203 * 1024
    # an A100 at block 64 (two query heads a KV head): Triton asked 196,608 bytes of its
    # 166,912 for one stage of 64 keys and 64 query rows; the fit takes the fewest rows
    # (a page of keys cannot shrink), which compiled (the estimate keeps 24 KiB spare)
    a100 = gpu_config.config_for(decode=False, kind="NVIDIA A100-SXM4-80GB", kv_itemsize=4,
                                 compute_itemsize=4, head_dim=256, block_size=64,
                                 group_padded=2)
    rows = gpu_config.query_rows(a100, decode=False, group_padded=2)
    assert (a100.num_stages, a100.block_kv, rows) == (1, 64, 16)
    assert 2 * 64 * 256 * 4 + rows * 256 * 4 <= 166_912
    # that smallest tiling fits the A100 whole (not refused); a 128-token float32 page of
    # head_dim 256 fits no GPU here (278,528 bytes at one stage)
    wide = dict(head_dim=256, kv_itemsize=4, compute_itemsize=4, group_padded=2)
    assert gpu_config.too_large_reason(block_size=64, kind="NVIDIA A100-SXM4-80GB", **wide) is None
    for kind in ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"):
        assert "278,528 bytes" in gpu_config.too_large_reason(block_size=128, kind=kind, **wide)
    table.write_text(json.dumps({"entries": [{"phase": "decode", "config": {"tile": 3}}]}))
    monkeypatch.setenv(gpu_config.ENV_TUNING, str(table) + ".other")
    table.rename(str(table) + ".other")
    with pytest.raises(ValueError, match="unknown config fields"):
        gpu_config.config_for(decode=True, kind="H100", **kw)
    gpu_config._table.cache_clear()


def test_committed_gpu_tuning_is_read():
    """``gpu_tuned.json`` (measured on a lent GPU) parses, says where it was measured,
    names only known knobs, and every entry is what the kernel runs at the heads it was
    tuned on (Llama-3-8B's: the shared-memory fit leaves it as measured)."""
    import json

    from pallas_kernels.ragged_paged_attention import gpu_config

    entries = gpu_config._entries_from(gpu_config.TUNED_FILE)
    assert entries and "measured" in json.loads(gpu_config.TUNED_FILE.read_text())
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        for entry in entries:
            got = gpu_config.config_for(
                decode=entry["phase"] == "decode", kv_itemsize=entry["kv_bytes"],
                compute_itemsize=2, head_dim=128, block_size=16, group_padded=4, kind=kind,
                kv_format=entry.get("kv_format"))
            assert {k: getattr(got, k) for k in entry["config"]} == entry["config"], entry


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_runs_under_jit_inside_scan(backend):
    """The model's call pattern: the public function under jit, inside a lax.scan."""
    case = make_case(rng_for("scan"), [1, 3], [6, 9], num_q_heads=4, num_kv_heads=2)
    q, k, v, *meta = case.args(poisoned=False)
    k2, v2 = jnp.stack([k, k]), jnp.stack([v, v])

    @jax.jit
    def two_layers(q, k2, v2, kv_lens, tables, cu, num_seqs):
        def layer(h, kv):
            out = ragged_paged_attention(h, kv[0], kv[1], kv_lens, tables, cu, num_seqs,
                                         sm_scale=0.2, backend=backend, interpret=INTERPRET)
            return jnp.where(jnp.isnan(h), h, out), None
        return jax.lax.scan(layer, q, (k2, v2))[0]

    @jax.jit
    def two_layers_reference(q, k2, v2, kv_lens, tables, cu, num_seqs):
        h = q
        for i in range(2):
            out = ragged_paged_attention(h, k2[i], v2[i], kv_lens, tables, cu, num_seqs,
                                         sm_scale=0.2, backend="reference")
            h = jnp.where(jnp.isnan(h), h, out)
        return h

    n = case.num_real_tokens
    got = np.asarray(two_layers(q, k2, v2, *meta))[:n]
    want = np.asarray(two_layers_reference(q, k2, v2, *meta))[:n]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(12))
def test_random_matrix(backend, seed):
    """Random draws over the whole matrix: batch kind, GQA ratio, head_dim, dtype, block
    size, padding, sliding window and soft cap."""
    rng = rng_for("matrix", seed)
    kind = ["decode", "prefill", "mixed", "boundary"][seed % 4]
    num_kv_heads = int(rng.choice([1, 2]))
    group = int(rng.choice([1, 3, 4, 8]))
    block_size = int(rng.choice([4, 8, 16]))
    q_lens, kv_lens = random_lens(rng, kind, int(rng.integers(1, 5)), 48, block_size)
    case = make_case(rng, q_lens, kv_lens, num_q_heads=group * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=int(rng.choice([64, 128])),
                     block_size=block_size, dtype=[np.float32, BF16][seed % 2],
                     pad_seqs=int(rng.integers(0, 3)), pad_tokens=int(rng.integers(0, 5)))
    window = int(rng.integers(1, 20)) if rng.random() < 0.4 else None
    cap = float(rng.uniform(1, 10)) if rng.random() < 0.4 else None
    run_and_compare(case, backend, sm_scale=float(rng.uniform(0.05, 0.3)),
                    sliding_window=window, soft_cap=cap)


@interpret_only
def test_interpret_mode_poisons_outputs():
    """Both interpret modes hand a kernel NaN-filled outputs: a kernel that writes nothing
    returns NaN, which is what makes the finiteness checks above meaningful."""
    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    x = jnp.ones((8, 128), jnp.float32)
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    gpu_style = pl.pallas_call(writes_nothing, out_shape=out_shape, interpret=True)(x)
    tpu_style = pl.pallas_call(writes_nothing, out_shape=out_shape,
                               interpret=pltpu.InterpretParams())(x)
    assert np.isnan(np.asarray(gpu_style)).all()
    assert np.isnan(np.asarray(tpu_style)).all()


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_layer_of_a_whole_cache(backend):
    """With ``layer`` the kernels read that layer's pages of [L, N, B, Hkv, D] in place:
    the same result as the layer's own 4-D cache (other layers hold NaN)."""
    if backend != "reference":
        require_backend(backend)
    case = make_case(rng_for("layer"), [1, 4, 2], [9, 4, 17], num_q_heads=8, num_kv_heads=2,
                     head_dim=128, block_size=16)
    q, k, v, *meta = case.args(poisoned=False)
    nan = jnp.full_like(k, jnp.nan)
    k5, v5 = jnp.stack([nan, nan, k]), jnp.stack([nan, nan, v])
    want = ragged_paged_attention(q, k, v, *meta, sm_scale=0.1, backend="reference")
    got = ragged_paged_attention(q, k5, v5, *meta, sm_scale=0.1, backend=backend,
                                 interpret=INTERPRET, layer=2)
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n],
                               **tolerance(case.q.dtype))
    with pytest.raises(ValueError, match="layer=5 is out of range"):
        ragged_paged_attention(q, k5, v5, *meta, sm_scale=0.1, layer=5)
