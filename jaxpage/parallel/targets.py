"""Accelerator targets described in software, for compiling without the hardware.

A *target* names a chip and how many of them: ``v5e:2x4`` (a TPU v5e slice of 2x4
chips), ``v6e:1x1`` (one chip), ``v5p:2x2x1``, ``h100`` (one GPU), ``h100x8`` (eight GPUs
on one host). ``open_target(name)`` returns a ``jax.experimental.topologies`` topology:
devices that are not there, which ``jax.jit(...).lower(...).compile()`` compiles for with
the real compilers (libtpu's for TPUs, the CUDA plugin's XLA and Triton for GPUs). What
comes back is a real executable with real errors and real memory figures, but no timing.

Needs the compilers: ``jax[tpu]`` (libtpu) for TPU targets, ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` of the installed jax's version (and ``absl-py``) for CUDA targets.
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` is set here before the CUDA plugin loads.

Chip figures (HBM, bandwidth, peak bf16 FLOP/s) are the vendors' published numbers; the
planner uses them for sizing and for roofline estimates, never as measurements. The
TPU HBM figure is the compiler's own budget per chip (what its out-of-memory error says
is available), read off libtpu's errors on this machine.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from functools import lru_cache
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's published figures."""

    key: str                   # "v5e", "h100", ...
    platform: str              # "tpu" or "cuda"
    description: str           # "TPU v5e", "NVIDIA H100 80GB HBM3 (SXM)"
    hbm_bytes: int             # per chip: the compiler's budget (TPU) / device memory (GPU)
    hbm_bandwidth: float       # bytes/s, published
    peak_flops: float          # dense bf16 FLOP/s, published
    gpu_target_config: str | None = None  # XLA GpuTargetConfig text proto (CUDA only)


def _gpu_config(*, major: int, minor: int, cores: int, fpus: int, smem_optin: int,
                smem_core: int, bandwidth: int, l2: int, clock_ghz: float, memory: int,
                name: str) -> str:
    """An XLA ``GpuTargetConfig`` text proto from a GPU's published figures."""
    return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: {smem_optin}
  shared_memory_per_core: {smem_core}
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock_ghz}
  device_memory_size: {memory}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 patch: 0 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{name}"
"""


_H100_MEMORY = 80 * 10**9     # 80 GB HBM3 as the driver reports it (~79.6 GiB usable)
_A100_MEMORY = 80 * 10**9

CHIPS: dict[str, Chip] = {chip.key: chip for chip in [
    # TPUs: HBM per chip as libtpu budgets it (v5e: "exceeds available HBM (15.75G)").
    Chip("v5e", "tpu", "TPU v5e", int(15.75 * GiB), 8.19e11, 197e12),
    Chip("v5p", "tpu", "TPU v5p", int(95.74 * GiB), 2.765e12, 459e12),
    Chip("v6e", "tpu", "TPU v6e (Trillium)", int(31.25 * GiB), 1.64e12, 918e12),
    Chip("h100", "cuda", "NVIDIA H100 80GB HBM3 (SXM)", _H100_MEMORY, 3.35e12, 989e12,
         _gpu_config(major=9, minor=0, cores=132, fpus=128, smem_optin=232448,
                     smem_core=233472, bandwidth=3_352_000_000_000, l2=52_428_800,
                     clock_ghz=1.98, memory=_H100_MEMORY, name="NVIDIA H100 80GB HBM3")),
    Chip("a100", "cuda", "NVIDIA A100-SXM4-80GB", _A100_MEMORY, 2.039e12, 312e12,
         _gpu_config(major=8, minor=0, cores=108, fpus=64, smem_optin=166912,
                     smem_core=167936, bandwidth=2_039_000_000_000, l2=41_943_040,
                     clock_ghz=1.41, memory=_A100_MEMORY, name="NVIDIA A100-SXM4-80GB")),
]}

_TPU_SHAPE = re.compile(r"^\d+(x\d+){1,2}$")
_GPU_COUNT = re.compile(r"^(?P<chip>[a-z0-9]+?)(x(?P<count>\d+))?$")


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed target name: a chip and a device count (and a TPU slice shape)."""

    name: str
    chip: Chip
    num_devices: int
    shape: tuple[int, ...] = ()  # TPU slice dimensions, e.g. (2, 4)

    @property
    def platform(self) -> str:
        return self.chip.platform


def parse_target(name: str) -> Target:
    """``v5e:2x4``, ``v6e:1x1``, ``v5p:2x2x1``, ``h100``, ``a100x8`` -> Target.

    Raises ``ValueError`` naming the offending target and the known chips.
    """
    text = name.strip().lower()
    if ":" in text:
        chip_key, shape_text = text.split(":", 1)
        chip = CHIPS.get(chip_key)
        if chip is None or chip.platform != "tpu" or not _TPU_SHAPE.match(shape_text):
            raise ValueError(f"target={name!r}: expected a TPU slice such as 'v5e:2x4' or "
                             f"'v5p:2x2x1' with a chip among {_tpu_keys()}")
        shape = tuple(int(x) for x in shape_text.split("x"))
        if min(shape) < 1:
            raise ValueError(f"target={name!r}: every slice dimension must be >= 1")
        return Target(name, chip, math.prod(shape), shape)
    match = _GPU_COUNT.match(text)
    chip = CHIPS.get(match.group("chip")) if match else None
    if chip is None or chip.platform != "cuda":
        raise ValueError(f"target={name!r} is not known: TPU slices are "
                         f"'<chip>:<shape>' with a chip among {_tpu_keys()} (e.g. 'v5e:2x4'); "
                         f"GPUs are {_gpu_keys()}, optionally 'x<count>' (e.g. 'h100x8')")
    count = int(match.group("count") or 1)
    if not 1 <= count <= 8:
        raise ValueError(f"target={name!r}: GPU targets have 1 to 8 devices on one host")
    return Target(name, chip, count)


def _tpu_keys() -> list[str]:
    return sorted(k for k, c in CHIPS.items() if c.platform == "tpu")


def _gpu_keys() -> list[str]:
    return sorted(k for k, c in CHIPS.items() if c.platform == "cuda")


def _tpu_topology_name(target: Target) -> tuple[str, dict[str, Any]]:
    shape = target.shape if len(target.shape) == 3 else target.shape + (1,)
    kwargs: dict[str, Any] = {}
    if math.prod(shape) <= 8:  # one host holds the whole slice
        kwargs["chips_per_host_bounds"] = shape
    return f"{target.chip.key}:{'x'.join(map(str, target.shape))}", kwargs


@lru_cache(maxsize=None)
def open_target(name: str):
    """The topology of ``name`` (devices that are not there), cached per name.

    Raises ``ValueError`` when the compiler for the target's platform is not installed.
    """
    from jax.experimental import topologies

    target = parse_target(name)
    if target.platform == "tpu":
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        # No chip is touched: let several processes compile for TPUs at once (libtpu
        # otherwise takes a lockfile meant for processes sharing real chips).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topology_name, kwargs = _tpu_topology_name(target)
        try:
            return topologies.get_topology_desc(topology_name=topology_name, platform="tpu",
                                                **kwargs)
        except Exception as error:  # libtpu missing, or a shape it does not know
            raise ValueError(f"target={name!r}: cannot describe this TPU slice ({error}); "
                             f"TPU targets need libtpu: pip install 'jax[tpu]'") from error
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    try:
        return topologies.get_topology_desc(
            target.chip.key, "cuda", target_config=target.chip.gpu_target_config,
            topology=f"1x1x{target.num_devices}")
    except Exception as error:
        raise ValueError(f"target={name!r}: cannot describe this GPU ({error}); CUDA "
                         f"targets need jax-cuda12-plugin and jax-cuda12-pjrt of jax's "
                         f"version and absl-py") from error


def target_devices(name: str) -> list:
    """The target's devices, in id order."""
    return sorted(open_target(name).devices, key=lambda d: d.id)


def single_device_spec(device, shape: tuple[int, ...], dtype) -> Any:
    """An abstract array of ``shape`` / ``dtype`` placed on one target ``device``."""
    import jax

    return jax.ShapeDtypeStruct(shape, dtype,
                                sharding=jax.sharding.SingleDeviceSharding(device))


def compile_on_device(device, fn, *arg_specs, static_kwargs: dict | None = None):
    """``jax.jit(fn).lower(*arg_specs).compile()`` for a target ``device``.

    ``arg_specs``: ``(shape, dtype)`` pairs, placed on ``device``, or None (an absent
    optional argument, such as a fused cache's ``v_cache``). Traced under
    ``jax.default_device(device)`` so that Pallas lowers for the device's platform
    (Mosaic asks the default device for its TPU generation, and the kernels' ``"auto"``
    backend follows it). Returns the compiled executable; compiler errors propagate.
    """
    import functools

    import jax

    specs = [None if spec is None else single_device_spec(device, *spec) for spec in arg_specs]
    call = functools.partial(fn, **(static_kwargs or {}))
    with jax.default_device(device):
        return jax.jit(call).lower(*specs).compile()
