"""Byte pages multiplied in float16 by the GPU kernel (``half_products``), interpret mode.

The path exists for speed on GPUs (fewer instructions per page element); what is checked
here is that it changes nothing a user could see: the same attention as the bfloat16 path
to within bfloat16's rounding for every byte format, queries beyond float16's range
included, the inline PTX conversions (int8, e5m2) stepped through for every byte, and the
tuning table's per-format entries that switch it on.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_quant import decode
from pallas_kernels.ragged_paged_attention import gpu_config, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention import half_products
from pallas_kernels.ragged_paged_attention.half_products import queries_in_halves
from tests.kernels.mode import INTERPRET, require_backend
from tests.kernels.test_kv_quant import LENS, _byte_case


def test_queries_are_brought_into_float16_range_by_exact_powers_of_two():
    """Rows under 2^15 pass unchanged; larger rows (up to bfloat16's 1e38) are divided by
    a power of two that brings them under it, and the returned factor undoes it."""
    rng = np.random.default_rng(0)
    peaks = np.array([0.0, 1e-3, 1.0, 3e4, 32767.0, 32768.0, 65504.0, 1e5, 3e9, 1e30, 3e38])
    rows = rng.standard_normal((len(peaks), 64))
    rows = rows / np.abs(rows).max(axis=1, keepdims=True) * peaks[:, None]
    q = jnp.asarray(rows, jnp.bfloat16)
    halves, up = queries_in_halves(q)
    assert halves.dtype == jnp.float16
    halves, up = np.asarray(halves, np.float32), np.asarray(up)
    assert np.isfinite(halves).all()
    assert np.abs(halves).max() < 2.0 ** 15
    np.testing.assert_array_equal(np.log2(up), np.round(np.log2(up)))   # powers of two
    exact = np.asarray(q, np.float32)
    small = np.abs(exact).max(axis=1) < 2.0 ** 15
    np.testing.assert_array_equal(up[small], 1.0)
    np.testing.assert_array_equal(halves[small], np.asarray(q.astype(jnp.float16), np.float32)[small])
    peak = np.abs(exact).max(axis=1, keepdims=True)
    assert (np.abs(halves * up[:, None] - exact) <= 2.0 ** -11 * peak).all()
    assert (up[~small] > 1).all()


@pytest.mark.parametrize("kv_format,lens", [("fp8_e4m3", LENS[1]), ("fp8_e4m3", LENS[2]),
                                            ("int8", LENS[2]), ("fp8_e5m2", LENS[1])])
def test_byte_pages_in_float16_give_the_bfloat16_paths_attention(kv_format, lens):
    """bfloat16 queries over byte pages: the float16 products are as close to float32's
    attention (over the same bfloat16 queries) as the bfloat16 products, and queries
    far beyond float16's 65,504 come out finite and right."""
    require_backend("gpu")
    case, q, k_bytes, v_bytes, rest = _byte_case(kv_format, lens, 2)
    n = case.num_real_tokens
    for q_scale in (1.0, 3e5):   # 3e5: the rows must be scaled into float16's range
        qb = (q * q_scale).astype(jnp.bfloat16)
        want = np.asarray(ragged_paged_attention(
            qb.astype(jnp.float32), decode(k_bytes, kv_format), decode(v_bytes, kv_format),
            *rest, sm_scale=0.125 / q_scale, backend="reference"))[:n]
        errors = {}
        for halves in (False, True):
            got = ragged_paged_attention_gpu(qb, k_bytes, v_bytes, *rest,
                                             sm_scale=0.125 / q_scale, interpret=INTERPRET,
                                             kv_format=kv_format, half_products=halves)
            got = np.asarray(got, np.float32)[:n]
            assert np.isfinite(got).all()
            errors[halves] = np.abs(got - want).max() / np.abs(want).max()
        assert errors[True] <= 8e-3, errors           # bfloat16 output rounding: 2^-8
        assert errors[True] <= 1.25 * errors[False] + 1e-4, errors


def test_float32_queries_keep_their_products():
    """float32 queries keep float32's products over every byte format: the knob changes
    none of their results."""
    require_backend("gpu")
    for kv_format, dtype in (("int8", jnp.float32), ("fp8_e5m2", jnp.float32),
                             ("fp8_e4m3", jnp.float32)):
        case, q, k_bytes, v_bytes, rest = _byte_case(kv_format, LENS[2], 3)
        q = q.astype(dtype)
        outs = [np.asarray(ragged_paged_attention_gpu(
            q, k_bytes, v_bytes, *rest, sm_scale=0.125, interpret=INTERPRET,
            kv_format=kv_format, half_products=halves), np.float32) for halves in (False, True)]
        np.testing.assert_array_equal(outs[0], outs[1])


def test_tuning_entries_can_name_their_byte_format(tmp_path, monkeypatch):
    """An entry with a ``kv_format`` applies to that byte format only, after the entries
    for every one-byte cache; an unknown format is refused."""
    monkeypatch.setattr(gpu_config, "TUNED_FILE", tmp_path / "none.json")
    table = tmp_path / "tuning.json"
    table.write_text(json.dumps({"entries": [
        {"phase": "decode", "kv_bytes": 1, "config": {"block_kv": 128}},
        {"phase": "decode", "kv_bytes": 1, "kv_format": "fp8_e4m3",
         "config": {"block_kv": 32, "half_products": True}}]}))
    monkeypatch.setenv(gpu_config.ENV_TUNING, str(table))
    gpu_config._table.cache_clear()
    kw = dict(decode=True, kv_itemsize=1, compute_itemsize=2, head_dim=128, block_size=16,
              kind="NVIDIA H100 80GB HBM3")
    try:
        fp8 = gpu_config.config_for(kv_format="fp8_e4m3", **kw)
        assert (fp8.block_kv, fp8.half_products) == (32, True)
        for other in ("int8", "fp8_e5m2"):
            got = gpu_config.config_for(kv_format=other, **kw)
            assert (got.block_kv, got.half_products) == (128, False), other
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"entries": [
            {"phase": "decode", "kv_bytes": 1, "kv_format": "int4", "config": {}}]}))
        monkeypatch.setenv(gpu_config.ENV_TUNING, str(bad))
        with pytest.raises(ValueError, match="kv_format"):
            gpu_config.config_for(kv_format="int8", **kw)
    finally:
        gpu_config._table.cache_clear()


def _run_ptx(asm: str, source: int) -> tuple[int, int]:
    """Steps through one of ``half_products``' inline PTX blocks (its ``xor.b32``,
    ``prmt.b32``, ``mov.b32`` and ``sub.f16x2``, as the PTX ISA defines them) for the
    32-bit input ``$2``; returns the outputs ``$0``, ``$1``."""
    regs = {"$2": source}

    def value(operand: str) -> int:
        return regs[operand] if operand in regs else int(operand, 0)

    for statement in asm.strip("{} \n").split(";"):
        words = statement.replace(",", " ").split()
        if not words or words[0].startswith(".reg"):
            continue
        op, dest, *args = words
        a, b = ([value(x) for x in args[:2]] + [0])[:2]
        if op == "xor.b32":
            result = a ^ b
        elif op == "mov.b32":
            result = a
        elif op == "prmt.b32":   # byte i of the result: byte (selector nibble i) of {b, a}
            pool = (a | (b << 32)).to_bytes(8, "little")
            selector = value(args[2])
            result = int.from_bytes(bytes(pool[(selector >> 4 * i) & 7] for i in range(4)),
                                    "little")
        elif op == "sub.f16x2":  # two float16 lanes, rounded to nearest
            lanes = [np.array([x & 0xFFFF, x >> 16], np.uint16).view(np.float16)
                     for x in (a, b)]
            diff = (lanes[0].astype(np.float32) - lanes[1].astype(np.float32))
            halves = diff.astype(np.float16).view(np.uint16)
            result = int(halves[0]) | (int(halves[1]) << 16)
        else:
            raise AssertionError(f"not stepped through: {op}")
        regs[dest] = result & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("kv_format", ["int8", "fp8_e5m2"])
def test_inline_ptx_conversions_give_every_bytes_float16_value(kv_format):
    """The int8 and e5m2 PTX, stepped through for all 256 bytes in each of the four places
    of an instance's register: the float16 of each byte's value, in element order
    (elements 0, 1 in the first output's low and high halves, 2, 3 in the second's)."""
    byte = np.arange(256, dtype=np.uint8)
    want = np.asarray(decode(jnp.asarray(byte), kv_format, jnp.float32))
    asm = half_products._ASM[kv_format]
    for place in range(4):
        for b in range(256):
            others = [(b * 37 + 11 * i) % 256 for i in range(4)]
            others[place] = b
            out0, out1 = _run_ptx(asm, int.from_bytes(bytes(others), "little"))
            got = np.array([out0 & 0xFFFF, out0 >> 16, out1 & 0xFFFF, out1 >> 16],
                           np.uint16).view(np.float16).astype(np.float32)
            np.testing.assert_array_equal(got, want[others], err_msg=f"byte {b}, place {place}")


@pytest.mark.parametrize("kv_format", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_bytes_in_halves_without_ptx_gives_every_bytes_exact_value(kv_format):
    """The jnp path (interpret mode, and the device's e4m3): float16 holds every byte's
    value of each format exactly."""
    byte = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
    got = half_products.bytes_in_halves(byte, kv_format, inline_ptx=False)
    assert got.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(decode(byte, kv_format, jnp.float32)))
