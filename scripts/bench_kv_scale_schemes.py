"""Which scales a one-byte KV cache needs: schemes emulated on SmolLM2, held-out text.

Each scheme quantizes and dequantizes the keys and values as they are made (float32 cache,
so no kernel has to know the scheme) and is measured as ``bench_quantization_quality.py``
measures a real option: teacher-forced top-1 agreement with float32 and mean KL over
every position of ``--corpus`` (default: the held-out corpus, windows of 512 tokens).
Keys and values are rotated first (``kv_quant.rotation``), as the shipped cache does.

Schemes (``SCHEME:FORMAT``, FORMAT ``int8`` or ``fp8`` = e4m3):

* ``static``: a scale per layer, KV head and channel, calibrated once (the largest
  |value| x 1.25 over the engine's own calibration text, ``kv_calibration``): what the
  shipped cache stores;
* ``sink``: ``static`` calibrated without position 0, and position 0 (the attention sink)
  with its own scalar on top: the first token alone made per-token;
* ``token``: a scale per token and KV head (its largest |value|); ``token_bf16`` that
  scale rounded to bfloat16 (2 bytes); ``token_pow2`` rounded up to a power of two
  (1 byte); ``token_shared`` one scale per token for all KV heads of the layer;
* ``token_sinkfloat``: ``token``, and position 0 (the attention sink) not quantized at
  all (what a float side buffer of one token per sequence would give);
* ``token_logN``: the per-token scale as one byte, ``2^(e/N)`` rounded up (N steps per
  octave; ``token_log16`` is what the int8 cache stores, ``kv_token_scale``); ``token_lsb8``
  that byte kept in the low bits of the first 8 of each head's D codes, which are rounded
  to even values (the fused TPU layout's place for it); ``token_lsb16v`` both codes in
  the first 16 of the value's (keys kept whole);
* ``mid`` / ``mean``: ``static`` scales around a static centre per channel (the middle of
  its calibrated range / its mean), never added back to keys (softmax ignores a constant
  key vector) and added back to values;
* ``static_x_token``: the static channel scales times a scalar per token and head;
* ``kt_X``: keys by scheme X, values ``static``;
* ``kshaped``: a scale per token and KV head, and the keys rounded channel by channel with
  each rounding error carried into the channels after it (GPTQ's update, weighted by the
  queries' second moment per layer and KV head from the calibration pass, dampened by
  ``SHAPING_DAMP`` of its mean diagonal, default 0.01), so that the error q . (k_hat - k)
  is least for the queries seen; values per token; ``shaped`` the values too, weighted by
  the output projection (sum over the group of W_o's block times its transpose);
  ``kshaped_vfloat`` the keys shaped and the values not quantized (the keys' share alone);
* ``kprecentered``: a scale per token and KV head, and the keys' pre-RoPE mean per layer,
  KV head and channel (calibrated), turned by each token's RoPE, taken out before the
  byte and added back after it (the mean is ~half the keys' energy on SmolLM2; a kernel
  would have to add ``q . RoPE_p(mean)`` per key position); ``precentered`` the values'
  mean too. Both print the means' share of the energy per layer first.

A ``+q8`` suffix (``token_log16:int8+q8``) also rounds each query row (token and head,
rotated as the keys are) to int8 codes with its own scale (largest |value| / 127): what a
kernel multiplying int8 queries by the int8 keys (integer tensor cores, no conversion of
the keys) would compute.

    python scripts/bench_kv_scale_schemes.py [--schemes static:int8,token:int8,token:fp8]

Patches ``DecoderLayer.qkv`` of this process's model code: a measurement, not a mode.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
os.environ.setdefault("JAXPAGE_CACHE_DIR", tempfile.mkdtemp())  # patched programs: never reuse

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import bench_quantization_quality as quality  # noqa: E402
from jaxpage.models import llama  # noqa: E402
from pallas_kernels.kv_quant import rotation  # noqa: E402

LIMITS = {"int8": 127.0, "fp8": 448.0}
HEADROOM = 1.25
_state: dict = {"scheme": None, "format": "int8", "layer": 0, "positions": None,
                "scales": {}, "capture": False, "q8": False}
_amax: dict = {}   # (key or value, layer, "all" | "rest") -> [Hkv, D] largest |rotated value|
_lo: dict = {}     # (key or value, layer) -> [Hkv, D] smallest / largest rotated value,
_hi: dict = {}     # their sum and count (the centred schemes)
_sum: dict = {}
_count: dict = {}


def _round(x, fmt: str):
    limit = LIMITS[fmt]
    x = jnp.clip(x, -limit, limit)
    return jnp.round(x) if fmt == "int8" else x.astype(jnp.float8_e4m3fn).astype(jnp.float32)


def _token_scale(xr, limit, axes=(-1,)):
    return jnp.maximum(jnp.abs(xr).max(axes, keepdims=True), 1e-8) / limit


def quantized(x, layer: int, which: int):
    """x [T, Hkv, D] -> x quantized and dequantized by the current scheme (which: 0 keys)."""
    scheme, fmt = _state["scheme"], _state["format"]
    if scheme.startswith("kt_"):
        scheme = scheme[3:] if which == 0 else "static"
    limit = LIMITS[fmt]
    r = jnp.asarray(rotation(x.shape[-1]))
    xr = jnp.einsum("thd,de->the", x.astype(jnp.float32), r, precision="highest")
    if scheme in ("token", "token_sinkfloat"):
        s = _token_scale(xr, limit)
    elif scheme == "token_bf16":   # rounded to bfloat16, nudged up so nothing saturates
        s = _token_scale(xr, limit).astype(jnp.bfloat16).astype(jnp.float32) * (1 + 2.0 ** -8)
    elif scheme == "token_pow2":
        s = 2.0 ** jnp.ceil(jnp.log2(_token_scale(xr, limit)))
    elif scheme.startswith("token_log"):   # 1 byte: scale = 2 ** (e / steps), rounded up
        steps = int(scheme[len("token_log"):])
        s = 2.0 ** (jnp.ceil(jnp.log2(_token_scale(xr, limit)) * steps) / steps)
    elif scheme in ("token_lsb8", "token_lsb16v"):   # token_log16, its code in low bits
        s = 2.0 ** (jnp.ceil(jnp.log2(_token_scale(xr, limit)) * 16) / 16)
        y = jnp.clip(jnp.round(xr / s), -limit, limit)
        even = jnp.clip(2 * jnp.round(xr / s / 2), -128, 126)
        stolen = 8 if scheme == "token_lsb8" else (16 if which == 1 else 0)
        y = jnp.where(jnp.arange(xr.shape[-1]) < stolen, even, y)
        return jnp.einsum("the,de->thd", y * s, r, precision="highest").astype(x.dtype)
    elif scheme in ("precentered", "kprecentered") and (which == 0 or scheme == "precentered"):
        # keys: the pre-RoPE mean, turned by each token's RoPE, taken out before the byte
        # and added back after it; values: their (rotated) mean likewise
        mean = jnp.asarray(_pre_sum[which, layer] / _pre_count[which, layer], jnp.float32)
        centre = jnp.broadcast_to(mean, x.shape)
        if which == 0:
            centre = llama.rotate(centre, _state["rope"])
        centre = centre.astype(jnp.float32)
        cr = jnp.einsum("thd,de->the", x.astype(jnp.float32) - centre, r, precision="highest")
        s = _token_scale(cr, limit)
        deq = jnp.einsum("the,de->thd", _round(cr / s, fmt) * s, r, precision="highest")
        return (deq + centre).astype(x.dtype)
    elif scheme in ("kprecentered",):   # values per token
        s = _token_scale(xr, limit)
    elif scheme == "kshaped_vfloat" and which == 1:   # values kept: the keys' share alone
        return x
    elif (scheme in ("shaped", "kshaped", "kshaped_vfloat") and which == 0
          or scheme == "shaped"):   # GPTQ-shaped rounding (keys; values too for "shaped")
        s = _token_scale(xr, limit)
        u = jnp.asarray(_shaping_factor(layer, which))
        y = _shaped_round(jnp.clip(xr / s, -limit, limit), u, fmt)
        return jnp.einsum("the,de->thd", y * s, r, precision="highest").astype(x.dtype)
    elif scheme == "kshaped":   # values: per token
        s = _token_scale(xr, limit)
    elif scheme == "token_shared":
        s = _token_scale(xr, limit, axes=(-1, -2))
    elif scheme in ("mid", "mean"):   # a static centre per channel, then a static scale
        lo, hi = _lo[which, layer], _hi[which, layer]
        centre = (lo + hi) / 2 if scheme == "mid" else _sum[which, layer] / _count[which, layer]
        reach = np.maximum(hi - centre, centre - lo)
        s = jnp.broadcast_to(jnp.asarray(np.maximum(reach * HEADROOM / limit, 1e-8)), xr.shape)
        c = jnp.asarray(centre, jnp.float32)
        deq = _round((xr - c) / s, fmt) * s
        # keys: the centre is never added back (softmax(q.k - q.c) = softmax(q.k));
        # values: it is (sum_j p_j (v_j - c) + c = sum_j p_j v_j)
        deq = deq if which == 0 else deq + c
        return jnp.einsum("the,de->thd", deq, r, precision="highest").astype(x.dtype)
    elif scheme in ("static", "sink", "static_x_token"):
        calibrated = "rest" if scheme == "sink" else "all"
        headroom = 1.0 if scheme == "static_x_token" else HEADROOM
        channel = jnp.asarray(np.maximum(_amax[which, layer, calibrated] * headroom / limit,
                                         1e-8))                       # [Hkv, D]
        s = jnp.broadcast_to(channel, xr.shape)
        if scheme == "sink":
            first = (_state["positions"] == 0)[:, None, None]
            s = jnp.where(first, s * jnp.maximum(_token_scale(xr / channel, limit), 1.0), s)
        elif scheme == "static_x_token":
            s = s * _token_scale(xr / channel, limit)
    else:
        raise SystemExit(f"unknown scheme {scheme!r}")
    out = jnp.einsum("the,de->thd", _round(xr / s, fmt) * s, r, precision="highest")
    if scheme == "token_sinkfloat":   # position 0 (the sink) kept unquantized
        out = jnp.where((_state["positions"] == 0)[:, None, None], x.astype(out.dtype), out)
    return out.astype(x.dtype)


_qq: dict = {}     # layer -> [Hkv, D, D] sum of (rotated q)(rotated q)^T over its group
_shaping: dict = {}  # (layer, keys 0 / values 1) -> [Hkv, D, D] upper Cholesky factor of
#                     the inverse of the error's dampened weighting (_shaping_factor)


def _record_queries(q, positions, layer: int, num_kv_heads: int) -> None:
    r = rotation(q.shape[-1])
    q = np.asarray(q, np.float64)[np.asarray(positions) >= 0] @ r        # [T, Hq, D]
    q = q.reshape(q.shape[0], num_kv_heads, -1, q.shape[-1])             # [T, Hkv, G, D]
    _qq[layer] = _qq.get(layer, 0.0) + np.einsum("thgd,thge->hde", q, q)


_wo: dict = {}     # layer -> [Hkv, D, D] sum over the group of W_o's block W_o^T (rotated)
DAMP = float(os.environ.get("SHAPING_DAMP", "0.01"))


def _record_output_projection(wo, layer: int, num_kv_heads: int, head_dim: int) -> None:
    if layer in _wo:   # the weights do not change between calibration calls
        return
    r = rotation(head_dim)
    wo = np.asarray(wo, np.float64).reshape(num_kv_heads, -1, head_dim, wo.shape[-1])
    gram = np.einsum("hgdo,hgfo->hdf", wo, wo, optimize=True)          # [Hkv, D, D]
    _wo[layer] = r.T @ gram @ r                                         # rotated basis


def _shaping_factor(layer: int, which: int) -> np.ndarray:
    """GPTQ's factor: the upper Cholesky factor of the inverse of the error's weighting
    (keys: the queries' second moment; values: the output projection's W_o W_o^T),
    dampened by ``DAMP`` of its mean diagonal, per KV head."""
    if (layer, which) not in _shaping:
        h = (_qq if which == 0 else _wo)[layer]
        h = h / max(np.trace(h, axis1=1, axis2=2).mean(), 1e-30)
        diagonal = np.mean(np.diagonal(h, axis1=1, axis2=2), axis=1)       # [Hkv]
        h = h + DAMP * diagonal[:, None, None] * np.eye(h.shape[-1])
        inv = np.linalg.inv(h)
        _shaping[layer, which] = np.stack([np.linalg.cholesky(m).T for m in inv]
                                          ).astype(np.float32)
    return _shaping[layer, which]


def _shaped_round(y, u, fmt: str):
    """y [T, Hkv, D] (scaled) rounded channel by channel, each channel's rounding error
    carried into the channels after it as GPTQ does (u: [Hkv, D, D] upper factor), so
    the error q . (k_hat - k) is least for the queries the calibration saw."""
    d = y.shape[-1]
    after = jnp.arange(d)

    def step(c, carry):
        y, out = carry
        rounded = _round(y[..., c], fmt)                                  # [T, Hkv]
        err = (y[..., c] - rounded) / u[:, c, c][None, :]                 # [T, Hkv]
        row = jnp.where(after > c, u[:, c, :], 0.0)                       # [Hkv, D]
        y = y - err[..., None] * row[None]
        return y, out.at[..., c].set(rounded)

    return lax.fori_loop(0, d, step, (y, jnp.zeros_like(y)))[1]


_pre_sum: dict = {}    # (keys 0 / values 1, layer) -> [Hkv, D] sum of pre-RoPE keys / values
_pre_count: dict = {}  # and their count (the precentered schemes)
_pre_energy: dict = {}  # and the sum of their squares


def _record_pre(k_pre, v, positions, layer: int) -> None:
    rows = np.asarray(positions) >= 0
    for which, x in ((0, np.asarray(k_pre, np.float64)), (1, np.asarray(v, np.float64))):
        x = x[rows]
        key = (which, layer)
        _pre_sum[key] = _pre_sum.get(key, 0.0) + x.sum(0)
        _pre_count[key] = _pre_count.get(key, 0) + x.shape[0]
        _pre_energy[key] = _pre_energy.get(key, 0.0) + (x * x).sum(0)


def _record(k, v, positions, layer: int) -> None:
    r = rotation(k.shape[-1])
    positions = np.asarray(positions)
    for which, x in ((0, np.asarray(k)), (1, np.asarray(v))):
        x = x @ r
        key = (which, layer)
        _lo[key] = np.minimum(_lo.get(key, np.inf), x.min(0))
        _hi[key] = np.maximum(_hi.get(key, -np.inf), x.max(0))
        _sum[key] = _sum.get(key, 0.0) + x.astype(np.float64).sum(0)
        _count[key] = _count.get(key, 0) + x.shape[0]
        x = np.abs(x)
        for name, rows in (("all", positions >= 0), ("rest", positions > 0)):
            if rows.any():
                key = (which, layer, name)
                _amax[key] = np.maximum(_amax.get(key, 0.0), x[rows].max(0))


def _int8_rows(q):
    """q [T, Hq, D] rotated, each row rounded to int8 codes of its own scale, and back."""
    r = jnp.asarray(rotation(q.shape[-1]))
    qr = jnp.einsum("thd,de->the", q.astype(jnp.float32), r, precision="highest")
    s = _token_scale(qr, LIMITS["int8"])
    return jnp.einsum("the,de->thd", _round(qr / s, "int8") * s, r,
                      precision="highest").astype(q.dtype)


def _patch() -> None:
    qkv, call = llama.DecoderLayer.qkv, llama.CausalLM.__call__

    def patched_qkv(self, cfg, h, rope, lora=None, rows=None):
        q, k, v = qkv(self, cfg, h, rope, lora, rows)
        layer = _state["layer"]
        _state["layer"] += 1
        _state["rope"] = rope
        if _state["capture"]:
            jax.debug.callback(lambda kk, vv, p: _record(kk, vv, p, layer), k, v,
                               _state["positions"])
            k_pre = llama.rotate(k, (rope[0], -rope[1]))   # RoPE undone
            jax.debug.callback(lambda kk, vv, p: _record_pre(kk, vv, p, layer), k_pre, v,
                               _state["positions"])
            jax.debug.callback(lambda qq, p: _record_queries(qq, p, layer, k.shape[1]), q,
                               _state["positions"])
            q_dim = q.shape[1] * q.shape[2]
            wo = llama.linear(jnp.eye(q_dim, dtype=h.dtype), self.o_proj, self.matmul_backend)
            jax.debug.callback(lambda w: _record_output_projection(w, layer, k.shape[1],
                                                                   k.shape[2]), wo)
            return q, k, v
        if _state["scheme"] is None:   # float32's reference
            return q, k, v
        if _state["q8"]:
            q = _int8_rows(q)
        return q, quantized(k, layer, 0), quantized(v, layer, 1)

    def patched_call(self, input_ids, positions, kv_cache, batch):
        _state["layer"], _state["positions"] = 0, positions
        return call(self, input_ids, positions, kv_cache, batch)

    llama.DecoderLayer.qkv, llama.CausalLM.__call__ = patched_qkv, patched_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="static:int8,sink:int8,token:int8,token_bf16:int8,"
                        "token_pow2:int8,token_shared:int8,static_x_token:int8,kt_token:int8,"
                        "static:fp8,token:fp8")
    parser.add_argument("--corpus", default=quality.DEFAULT_CORPUS)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    from jaxpage import LLM
    from jaxpage.engine.startup.kv_calibration import MAX_CALIBRATION_TOKENS, calibration_ids
    from jaxpage.engine.tokenizer import load_tokenizer
    from jaxpage.models.loader import default_model_path

    _patch()
    tokenizer = load_tokenizer(default_model_path(), None)
    ids = tokenizer(quality.corpus_text(args.corpus)).input_ids
    windows = [w for w in (ids[i:i + args.window] for i in range(0, len(ids), args.window))
               if len(w) > 1]
    engine = dict(max_model_len=args.window + 32, max_num_seqs=16,
                  max_num_batched_tokens=args.window, num_kv_blocks=4 * args.window // 16 + 64)
    reference = quality.evaluate(None, windows, None, engine).pop("_logprobs")
    _state["capture"] = True   # the static scales: one pass over the engine's own text
    llm = LLM(**engine)
    calibration = calibration_ids(tokenizer, len(tokenizer), MAX_CALIBRATION_TOKENS)
    llm.llm_engine.prompt_logits([{"prompt_token_ids": [int(t) for t in calibration]}])
    jax.effects_barrier()
    _state["capture"] = False
    del llm
    for which, name in ((0, "keys (pre-RoPE)"), (1, "values")):
        shares = [float((_pre_sum[which, n] ** 2 / _pre_count[which, n]).sum()
                        / _pre_energy[which, n].sum())
                  for n in range(len({k[1] for k in _pre_sum}))]
        print(f"{name}: the mean's share of the energy per layer: "
              + " ".join(f"{x:.2f}" for x in shares))
    print(f"SmolLM2-135M-Instruct, {len(ids)} tokens of {os.path.relpath(args.corpus, ROOT)}, "
          f"windows of {args.window}; emulated (quantize-dequantize into a float32 cache)")
    print("| scheme | format | top-1 agree | mean KL | perplexity |")
    print("|---|---|---|---|---|")
    for spec in args.schemes.split(","):
        _state["scheme"], _, _state["format"] = spec.partition(":")
        _state["format"], plus, extra = _state["format"].partition("+")
        if plus and extra != "q8":
            raise SystemExit(f"{spec!r}: the only suffix is '+q8'")
        _state["q8"] = extra == "q8"
        if _state["format"] not in LIMITS:
            raise SystemExit(f"{spec!r}: the format must be one of {tuple(LIMITS)}")
        start = time.perf_counter()
        row = quality.evaluate(None, windows, reference, engine)
        print(f"| {_state['scheme']} | {_state['format']}{' + int8 queries' * _state['q8']} "
              f"| {row['top1_agree']:.2%} | "
              f"{row['kl']:.5f} | {row['perplexity']:.3f} |  ({time.perf_counter() - start:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
