"""Public ragged paged attention: validates shapes, then dispatches to a backend.

New tokens of sequence ``i`` are the last ``cu_q_lens[i+1] - cu_q_lens[i]`` positions of
its ``kv_lens[i]`` cached tokens and attend causally. Rows of padding tokens are zero.

Backends: ``"reference"`` (plain jnp, exact, any platform), ``"cpu"`` (a C++ kernel called
through XLA's FFI, float32, ``cpu.py``), ``"gpu"`` (Pallas, Triton lowering, ``gpu.py``),
``"tpu"`` (Pallas Mosaic TPU, ``tpu.py``). ``"auto"`` picks by the platform
(``_backend.current_platform()``: the default device's, else ``jax.default_backend()``):
gpu on a GPU, tpu on a TPU, and on the CPU the C++ kernel when it could be built (a C++
compiler is needed; ``JAXPAGE_CPU_KERNELS=0`` turns it off) and the cache is float32, else
the reference.
``interpret=True`` runs the chosen Pallas kernel in Pallas interpret mode, on any
platform; asking for ``"gpu"`` / ``"tpu"`` on another platform without it raises a
``ValueError``. ``interpret`` does nothing for the reference. Under ``"auto"`` a GPU falls
back to the reference for shapes the Triton kernel cannot tile (a head_dim or block_size
that is not a power of two, or a page too large for the device's shared memory); an
explicit ``"gpu"`` raises a ``ValueError`` for them.
The Pallas backends need ``sm_scale`` (and ``soft_cap``) as Python numbers: they are
compile-time constants of the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.kv_quant import check_format, fold_key_scale, unfold_value_scale
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

BACKENDS = _backend.BACKENDS


def resolve_backend(backend: str, *, interpret: bool = False, dtype=None) -> str:
    """The concrete backend ("reference", "cpu", "gpu" or "tpu") for ``backend`` here.

    On the CPU, ``"auto"`` means the C++ kernel if it is available for ``dtype`` (float32
    when None), and ``"cpu"`` raises a ``ValueError`` when it is not. Resolving to
    ``"cpu"`` registers the kernel with XLA, so compiled programs that call it can be
    loaded from disk afterwards.
    """
    resolved = _backend.resolve(backend, interpret=interpret)
    if resolved == "reference" and backend == "auto" and _backend.current_platform() == "cpu":
        import pallas_kernels.ragged_paged_attention.cpu as cpu
        return "cpu" if cpu.available(dtype or jnp.float32) else "reference"
    if resolved == "cpu":
        import pallas_kernels.ragged_paged_attention.cpu as cpu
        if not cpu.available(dtype or jnp.float32):
            raise ValueError(f"backend='cpu' needs float32 q, k_cache and v_cache (got "
                             f"{dtype}) and a C++ compiler to build the kernel (see the log; "
                             f"JAXPAGE_CPU_KERNELS=0 also turns it off); use "
                             f"backend='reference'")
    return resolved


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_shapes(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> None:
    """Raise ``ValueError`` naming the offending shape or value; see the module docstring."""
    _check(q.ndim == 3, f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    _check(k_cache.ndim == 4 and k_cache.shape == v_cache.shape,
           f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
           f"got {k_cache.shape} and {v_cache.shape}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _check(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    _check(q.shape[1] % num_kv_heads == 0,
           f"num_q_heads={q.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}")
    _check(block_tables.ndim == 2, f"block_tables must be 2-D, got shape {block_tables.shape}")
    max_num_seqs = block_tables.shape[0]
    _check(kv_lens.shape == (max_num_seqs,),
           f"kv_lens shape {kv_lens.shape} != (max_num_seqs={max_num_seqs},)")
    _check(cu_q_lens.shape == (max_num_seqs + 1,),
           f"cu_q_lens shape {cu_q_lens.shape} != (max_num_seqs + 1 = {max_num_seqs + 1},)")
    _check(num_seqs.shape == (1,), f"num_seqs must have shape (1,), got {num_seqs.shape}")
    _check(sliding_window is None or sliding_window >= 1,
           f"sliding_window={sliding_window!r} must be None or >= 1")
    _check(soft_cap is None or soft_cap > 0, f"soft_cap={soft_cap!r} must be None or > 0")


def check_kv_format(k_cache, v_cache, kv_format: str | None) -> None:
    """Byte caches (uint8) go with a ``kv_format`` and float caches without one
    (``v_cache`` None: a fused cache, ``kv_layout``)."""
    check_format(kv_format)
    v_dtype = k_cache.dtype if v_cache is None else v_cache.dtype
    is_bytes = k_cache.dtype == jnp.uint8 and v_dtype == jnp.uint8
    _check(is_bytes == (kv_format is not None),
           f"kv_format={kv_format!r} with caches of {k_cache.dtype} / {v_dtype}: int8 and "
           f"fp8 caches are uint8 bytes with their kv_format; float caches take none")


def check_token_scales(k_cache, v_cache, kv_format: str | None, token_scales) -> None:
    """Per-token scale codes (``kv_token_scale``) go with a split byte cache: uint8, one
    per token and KV head of each cache (its shape without head_dim)."""
    if token_scales is None:
        return
    _check(kv_format is not None and v_cache is not None,
           f"token_scales need a split byte cache (kv_format={kv_format!r}, "
           f"{'fused' if v_cache is None else 'split'} layout)")
    _check(len(token_scales) == 2 and all(
               s.dtype == jnp.uint8 and s.shape == k_cache.shape[:-1] for s in token_scales),
           f"token_scales must be (key codes, value codes), uint8 {k_cache.shape[:-1]} each, "
           f"got {[(s.shape, str(s.dtype)) for s in token_scales]}")


def ragged_paged_attention(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                           sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, backend: str = "auto",
                           interpret: bool = False, layer: int | None = None,
                           kv_format: str | None = None, k_scale: jax.Array | None = None,
                           v_scale: jax.Array | None = None,
                           token_scales: tuple[jax.Array, jax.Array] | None = None
                           ) -> jax.Array:
    """Attention of concatenated ragged queries over a paged KV cache -> [T, Hq, D].

    ``kv_format`` (``pallas_kernels.kv_quant``): the caches are ``uint8`` bytes of that
    format, converted to q's dtype as pages are read, standing for ``k_scale`` /
    ``v_scale`` [Hkv, D] times their values (None: ones), and, with ``token_scales``
    (key and value scale codes, uint8 shaped like the caches without head_dim), times
    each token's own scale (``kv_token_scale``; split caches; the TPU kernel reads fused
    rows and falls back to the reference for them). A fused int8 cache carries those
    codes in its value bytes (``kv_token_scale.embedded``), read by the reference and the
    TPU kernel.

    With ``layer`` the caches are every layer's, ``[L, N, B, Hkv, D]``, and layer
    ``layer``'s pages are read in place (no slice or reshape of the cache, which on a TPU
    would be a copy of it). The C++ CPU kernel takes 4-D caches only; its fused
    per-layer call is ``write_and_attend``.

    ``v_cache`` None: ``k_cache`` is a fused cache (``kv_layout``), ``[(L,) N, B, W]``,
    which the TPU kernel and the reference read (the others fall back to the reference).
    """
    page_view = _backend.layer_view(k_cache, v_cache, layer, head_dim=q.shape[-1])
    check_shapes(q, page_view, page_view, kv_lens, block_tables, cu_q_lens, num_seqs,
                 sliding_window=sliding_window, soft_cap=soft_cap)
    check_kv_format(k_cache, v_cache, kv_format)
    check_token_scales(k_cache, v_cache, kv_format, token_scales)
    v_dtype = k_cache.dtype if v_cache is None else v_cache.dtype
    same_dtype = (q.dtype == k_cache.dtype == v_dtype if kv_format is None
                  else True)  # byte caches: the kernels take q's dtype
    resolved = resolve_backend(backend, interpret=interpret,
                               dtype=q.dtype if same_dtype else jnp.float64)  # mixed: not the kernel's
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if resolved == "cpu" and layer is not None:
        resolved = "reference"  # the C++ kernel's per-layer form is write_and_attend's
    if v_cache is None and resolved in ("cpu", "gpu"):
        resolved = "reference"  # their kernels read split pages only
    if token_scales is not None:
        kwargs["token_scales"] = tuple(token_scales)
        if resolved == "tpu":
            resolved = "reference"  # Mosaic reads fused rows, whose int8 bytes carry them
    if kv_format is not None:
        kwargs["kv_format"] = kv_format
        if resolved == "cpu" and q.shape[0] > 0:
            # the C++ kernel multiplies the scales in as it converts each block
            kwargs.update(k_scale=k_scale, v_scale=v_scale)
        else:  # the others read values only: the scales go into q and the output
            q = fold_key_scale(q, k_scale)
            out = _dispatch(resolved, backend, interpret, layer,
                            (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs),
                            kwargs)
            return unfold_value_scale(out, v_scale)
    return _dispatch(resolved, backend, interpret, layer,
                     (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs), kwargs)


def _dispatch(resolved: str, backend: str, interpret: bool, layer: int | None, args: tuple,
              kwargs: dict) -> jax.Array:
    q, k_cache = args[0], args[1]
    if layer is not None:
        kwargs["layer"] = layer
    if resolved == "reference" or q.shape[0] == 0:
        return ragged_paged_attention_reference(*args, **kwargs)
    if resolved == "cpu":
        from pallas_kernels.ragged_paged_attention.cpu import ragged_paged_attention_cpu
        return ragged_paged_attention_cpu(*args, **kwargs)
    if resolved == "gpu":
        import pallas_kernels.ragged_paged_attention.gpu as gpu
        reason = gpu.call_unsupported_reason(q, k_cache, kv_format=kwargs.get("kv_format"),
                                             interpret=interpret)
        if reason and backend == "auto":
            return ragged_paged_attention_reference(*args, **kwargs)  # shapes Triton can't tile
        return gpu.ragged_paged_attention_gpu(*args, interpret=interpret, **kwargs)
    from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
    return ragged_paged_attention_tpu(*args, interpret=interpret, **kwargs)


__all__ = ["check_shapes", "ragged_paged_attention", "ragged_paged_attention_reference",
           "resolve_backend"]
