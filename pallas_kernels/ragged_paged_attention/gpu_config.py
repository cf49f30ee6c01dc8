"""How the Pallas GPU attention kernel tiles a batch: its tunable knobs, the measured
choice of them per GPU, and which shapes it cannot take (``unsupported_reason``).

A ``GpuKernelConfig`` holds what the kernel's speed depends on and its numbers do not:
the KV tokens one loop step loads, the Triton warps and pipeline stages, how many
programs the grid should reach before the KV range is split (flash decoding), and the
grid's order. ``config_for`` picks one for a call from

1. ``JAXPAGE_GPU_ATTENTION_TUNING``: a JSON file of entries (what
   ``scripts/tune_gpu_attention.py`` writes on a GPU), when set;
2. ``gpu_tuned.json`` beside this file: the entries measured on lent GPUs, committed
   with their measurements (``docs/benchmarks/accelerator/``);
3. ``DEFAULTS``: the untuned choice.

An entry applies to a device whose ``device_kind`` contains its ``device`` (``"H100"``,
``"H200"``; ``""`` for any), a ``phase`` (``"decode"``: every sequence brings at most one
token per KV head's tile, the batch no larger than its sequences; ``"prefill"``
otherwise) and the KV cache's bytes per element (2: bf16 / fp16, 1: int8 / fp8, 4:
float32), and, when it names a ``kv_format`` (``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``),
to that byte format only; the last matching entry wins. Whatever it says, ``fit_shared_memory`` keeps the
pipelined K / V tiles inside the device's shared memory (an H100 has 227 KiB a block; a
float32 head_dim-256 tile of 64 keys in 2 stages needs 272 KiB and did not compile).
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.ragged_paged_attention.tiling import next_pow2, num_tiles_for

TUNED_FILE = Path(__file__).with_name("gpu_tuned.json")
ENV_TUNING = "JAXPAGE_GPU_ATTENTION_TUNING"
PHASES = ("decode", "prefill")
BYTE_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")   # kv_quant.KV_FORMATS' names
# Shared memory a block may take, in bytes, by device kind (Hopper: 227 KiB; Ampere
# A100: 163 KiB; others: 99 KiB), less what the kernel's other buffers need.
SHARED_MEMORY = (("H100", 227 * 1024), ("H200", 227 * 1024), ("H800", 227 * 1024),
                 ("A100", 163 * 1024), ("A800", 163 * 1024))
SHARED_MEMORY_OTHER = 99 * 1024
SHARED_MEMORY_SPARE = 24 * 1024
MIN_DOT = 16  # Triton's tensor-core dot wants every dimension >= 16


@dataclasses.dataclass(frozen=True)
class GpuKernelConfig:
    """The kernel's tiling knobs (none of them changes its results beyond rounding)."""

    block_q: int | None = None   # new tokens per query tile (None: 16 rows decode, 64 prefill)
    block_kv: int = 64           # KV tokens per loop step (a multiple of the block size)
    num_warps: int = 4
    num_stages: int = 2          # Triton's software pipeline depth for the loop's loads
    target_programs: int = 1024  # programs the grid should have before the KV is split
    heads_fastest: bool = False  # grid (kv head, tile, split) instead of (tile, kv head, split)
    direct_io: bool = True       # the kernel gathers its q rows and writes its output rows in
                                 # place (False: XLA tiles q before the call and untiles after)
    mask_split: bool = True      # KV blocks every row sees whole run a loop without the mask
    prefetch: bool = False       # each loop step loads the next block's pages into registers
                                 # (with num_stages 1: byte caches then skip shared memory)
    half_products: bool = False  # byte pages become float16, not bfloat16, and are multiplied
                                 # in float16 (16-bit queries; ``half_products.py``)
    longest_first: bool = False  # the grid walks the tiles last to first, so the tiles that
                                 # attend to the most keys start first (``tiling.longest_first``)
    merge_kernel: bool = True    # KV splits merged by one Pallas kernel (``split_merge.py``)
                                 # instead of XLA's two; with ``direct_io`` only

    def replace(self, **changes) -> "GpuKernelConfig":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(GpuKernelConfig))
DEFAULTS = {
    "decode": GpuKernelConfig(block_kv=64, num_warps=4, num_stages=2, target_programs=1024),
    # prefill tiles carry more work each; a quarter of the target fills the chip
    # longest tiles first: a causal prefill's tiles differ in length up to the context
    "prefill": GpuKernelConfig(block_kv=64, num_warps=4, num_stages=2, target_programs=256,
                               longest_first=True),
}


def _entries_from(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    entries = data["entries"] if isinstance(data, dict) else data
    for entry in entries:
        if entry.get("phase") not in PHASES:
            raise ValueError(f"{path}: entry {entry} needs a phase in {PHASES}")
        if entry.get("kv_format", "int8") not in BYTE_FORMATS:
            raise ValueError(f"{path}: entry {entry} names a kv_format not in {BYTE_FORMATS}")
        unknown = set(entry.get("config", {})) - set(FIELDS)
        if unknown:
            raise ValueError(f"{path}: entry {entry} has unknown config fields {sorted(unknown)}")
    return entries


@lru_cache(maxsize=None)
def _table(env_path: str | None) -> tuple[dict, ...]:
    entries = _entries_from(TUNED_FILE) if TUNED_FILE.exists() else []
    if env_path:
        entries += _entries_from(Path(env_path))
    return tuple(entries)


def device_kind() -> str:
    """The kind of GPU programs are being built for: the default device's when one is set
    (a deviceless target, ``jaxpage.parallel.targets``), else the first device's; "" when
    that is not a GPU."""
    device = _backend.current_device()
    return device.device_kind if _backend.platform_backend(device.platform) == "gpu" else ""


def tuned(phase: str, kv_itemsize: int, kind: str,
          kv_format: str | None = None) -> GpuKernelConfig:
    """The table's choice for this phase, KV element size, device kind and byte format
    (None: a float cache) before the shared-memory fit."""
    config = DEFAULTS[phase]
    for entry in _table(os.environ.get(ENV_TUNING) or None):
        if (entry["phase"] == phase and entry.get("kv_bytes", kv_itemsize) == kv_itemsize
                and entry.get("device", "") in kind
                and entry.get("kv_format", kv_format) == kv_format):
            config = dataclasses.replace(DEFAULTS[phase], **entry.get("config", {}))
    return config


def shared_memory_limit(kind: str) -> int:
    """The shared memory one block of ``kind`` may take, in bytes."""
    return next((size for name, size in SHARED_MEMORY if name in kind), SHARED_MEMORY_OTHER)


def shared_memory_budget(kind: str) -> int:
    """What ``fit_shared_memory`` aims the estimate at: the limit less a spare."""
    return shared_memory_limit(kind) - SHARED_MEMORY_SPARE


def fit_shared_memory(config: GpuKernelConfig, *, head_dim: int, kv_itemsize: int,
                      compute_itemsize: int, block_size: int, decode: bool,
                      group_padded: int, kind: str) -> GpuKernelConfig:
    """``config`` with fewer pipeline stages, then fewer KV tokens a step (down to a page),
    then fewer query tokens a tile, until what the kernel keeps in shared memory fits the
    device's: ``num_stages`` buffered K and V tiles
    (``block_kv x head_dim`` each, in the cache's dtype), for a byte cache one converted
    tile in the queries' dtype, and the ``rows x head_dim`` query tile. (Measured against
    Triton's own figure: float32, head_dim 256, 64 keys, 2 stages, 16 rows asked an H100
    for 278,784 bytes; 1 stage, 64 rows asked an A100 for 196,608.)"""
    budget = shared_memory_budget(kind)
    # the KV tokens the kernel loads a step (``choose_blocks``): a power of two of at
    # least 16, and at least a page
    block_kv = max(next_pow2(max(config.block_kv, 16)), block_size)
    stages = config.num_stages
    rows = query_rows(config, decode=decode, group_padded=group_padded)
    block_q = config.block_q

    def need() -> int:
        return shared_memory_need(stages=stages, block_kv=block_kv, rows=rows,
                                  head_dim=head_dim, kv_itemsize=kv_itemsize,
                                  compute_itemsize=compute_itemsize)

    while need() > budget and stages > 1:
        stages -= 1
    while need() > budget and block_kv > max(16, block_size):
        block_kv //= 2
    while need() > budget and rows > 16 and rows // group_padded > 1:
        rows //= 2
        block_q = rows // group_padded
    return dataclasses.replace(config, block_kv=block_kv, num_stages=stages, block_q=block_q)


def shared_memory_need(*, stages: int, block_kv: int, rows: int, head_dim: int,
                       kv_itemsize: int, compute_itemsize: int) -> int:
    """Bytes of shared memory the kernel keeps (``fit_shared_memory``'s estimate)."""
    converted = block_kv * head_dim * compute_itemsize if kv_itemsize < compute_itemsize else 0
    return (2 * max(stages, 1) * block_kv * head_dim * kv_itemsize + converted
            + rows * head_dim * compute_itemsize)


def too_large_reason(*, head_dim: int, block_size: int, kv_itemsize: int,
                     compute_itemsize: int, group_padded: int, kind: str) -> str | None:
    """Why even the smallest tiling (one stage, one page of keys a step, the fewest query
    rows) overflows the device's shared memory; None when it fits. The kernel loads whole
    pages, so a page of a wide float32 head can be too much on its own (head_dim 256,
    128-token pages: 256 KiB of K and V against an H100's 227 KiB). Measured against the
    whole limit, not the fit's budget: for that smallest tiling the estimate was Triton's
    own figure (147,456 bytes at head_dim 256, 64-token float32 pages, which an A100's
    166,912 held)."""
    need = shared_memory_need(stages=1, block_kv=max(16, block_size),
                              rows=max(16, group_padded), head_dim=head_dim,
                              kv_itemsize=kv_itemsize, compute_itemsize=compute_itemsize)
    budget = shared_memory_limit(kind)
    if need <= budget:
        return None
    return (f"the Pallas GPU kernel needs {need:,} bytes of shared memory for one page of "
            f"{block_size} tokens at head_dim {head_dim} in {kv_itemsize}-byte elements, "
            f"more than the {budget:,} it may use on {kind or 'this GPU'}: use a smaller "
            f"block_size or a narrower dtype")


def query_rows(config: GpuKernelConfig, *, decode: bool, group_padded: int) -> int:
    """Rows of a query tile: ``block_q`` tokens (default 16 rows decode, 64 prefill) times
    the padded group, at least 16 (what ``choose_blocks`` makes of it)."""
    block_q = config.block_q or max(1, (16 if decode else 64) // group_padded)
    return max(16, block_q * group_padded)


def config_for(*, decode: bool, kv_itemsize: int, compute_itemsize: int, head_dim: int,
               block_size: int, group_padded: int = 1, kind: str | None = None,
               kv_format: str | None = None, **given) -> GpuKernelConfig:
    """The kernel's configuration for one call (see the module docstring): the table's,
    with the knobs ``given`` (not None) in their place, fitted to shared memory."""
    kind = device_kind() if kind is None else kind
    config = tuned("decode" if decode else "prefill", kv_itemsize, kind,
                   kv_format).replace(**given)
    return fit_shared_memory(config, head_dim=head_dim, kv_itemsize=kv_itemsize,
                             compute_itemsize=compute_itemsize, block_size=block_size,
                             decode=decode, group_padded=group_padded, kind=kind)


def unsupported_reason(*, head_dim: int, block_size: int, kv_itemsize: int | None = None,
                       compute_itemsize: int | None = None, group: int = 1,
                       kind: str | None = None) -> str | None:
    """Why this kernel cannot take these shapes (None when it can). With the element
    sizes, also whether one page's tiles fit the device's shared memory
    (``too_large_reason``; ``kind``: the device kind, default the device's)."""
    for name, value in (("head_dim", head_dim), ("block_size", block_size)):
        if value & (value - 1):
            return f"the Pallas GPU kernel needs a power-of-two {name}, got {value}"
    if kv_itemsize is None:
        return None
    return too_large_reason(head_dim=head_dim, block_size=block_size, kv_itemsize=kv_itemsize,
                            compute_itemsize=compute_itemsize or kv_itemsize,
                            group_padded=next_pow2(group),
                            kind=device_kind() if kind is None else kind)


def call_unsupported_reason(q: jax.Array, k_cache: jax.Array, *, kv_format: str | None,
                            interpret: bool) -> str | None:
    """``unsupported_reason`` for one call: q [T, Hq, D] and a split cache ``[(L,) N, B,
    Hkv, D]`` (bytes for ``kv_format``, converted to q's dtype); shared memory is not
    checked in interpret mode (no device)."""
    compute = q.dtype if kv_format is not None else k_cache.dtype
    return unsupported_reason(
        head_dim=q.shape[-1], block_size=k_cache.shape[-3],
        kv_itemsize=None if interpret else jnp.dtype(k_cache.dtype).itemsize,
        compute_itemsize=jnp.dtype(compute).itemsize, group=q.shape[1] // k_cache.shape[-2])


def choose_blocks(*, num_tokens: int, max_num_seqs: int, group: int, block_size: int,
                  max_blocks_per_seq: int, num_kv_heads: int, block_q: int | None = None,
                  block_kv: int | None = None, num_kv_splits: int | None = None,
                  target_programs: int | None = None) -> tuple[int, int, int, int]:
    """Static tiling: (block_q, group_padded, pages_per_block, num_kv_splits).

    Unset knobs take the untuned defaults (``gpu_config.DEFAULTS``); the kernel passes
    its configuration's."""
    group_padded = next_pow2(group)
    decode_shaped = num_tokens <= max_num_seqs
    default = DEFAULTS["decode" if decode_shaped else "prefill"]
    if block_q is None:
        block_q = max(1, (MIN_DOT if decode_shaped else 64) // group_padded)
    block_q = next_pow2(block_q)
    block_q = max(block_q, next_pow2(-(-MIN_DOT // group_padded)))
    if block_kv is None:
        block_kv = default.block_kv
    pages_per_block = max(1, next_pow2(max(block_kv, MIN_DOT)) // block_size)
    kv_blocks = -(-max_blocks_per_seq // pages_per_block)
    if num_kv_splits is None:
        target = target_programs or default.target_programs
        num_tiles = num_tiles_for(num_tokens, max_num_seqs, block_q)
        # any count, not only powers of two: programs = target rounded up to whole
        # (tile, head) pairs, so a target sized to the SMs' slots fills its waves
        num_kv_splits = -(-target // (num_tiles * num_kv_heads))
    num_kv_splits = max(1, min(num_kv_splits, kv_blocks))
    return block_q, group_padded, pages_per_block, num_kv_splits
