"""What ``plan`` found: per program, per device memory, KV capacity, a roofline; as text."""

from __future__ import annotations

import dataclasses
from typing import Any

GiB = 2**30
# A program's temporaries "grow with the cache" when they add more than this fraction of
# a KV block's bytes per block (the compiler's figures move by a few bytes otherwise).
GROWTH_TOLERANCE = 0.05
# A cache smaller than this (per device) that seems to grow is measured again at this
# size: beyond the on-chip memory (VMEM: 128 MiB on a v5e or v6e) a compiler could move
# the whole cache into, which reads as temporaries growing with it.
GROWTH_PROBE_BYTES = 512 * 2**20


@dataclasses.dataclass
class ProgramResult:
    """One program compiled for the target (or the compiler's error)."""

    label: str                    # "step[64, 64, 128]"
    compiled: bool
    seconds: float = 0.0
    device_bytes: int = 0         # arguments + outputs - aliases + temporaries, per device
    temp_bytes: int = 0           # the compiler's temporaries, per device
    bytes_accessed: float = 0.0   # the compiler's cost analysis, per device
    flops: float = 0.0
    error: str | None = None
    # temporaries added per KV block, from a second compile at a smaller cache (None: not
    # measured); more than ``GROWTH_TOLERANCE`` of a block's bytes means the program
    # copies (part of) the cache instead of updating it in place
    temp_bytes_per_block: float | None = None
    grows_with_cache: bool = False

    def line(self) -> str:
        if not self.compiled:
            return f"{self.label}: FAILED ({self.error})"
        growth = ""
        if self.grows_with_cache:
            growth = (f", GROW with the KV cache by {self.temp_bytes_per_block:.0f} bytes "
                      f"per block")
        elif self.temp_bytes_per_block is not None:
            growth = ", constant in the KV cache size"
        return (f"{self.label}: compiled in {self.seconds:.1f} s, "
                f"{self.device_bytes / GiB:.2f} GiB per device, "
                f"temporaries {self.temp_bytes / 2**20:.1f} MiB{growth}")


@dataclasses.dataclass
class RooflineRow:
    """Estimated decode speed at one batch bucket (not a measurement)."""

    batch: int
    context: int                  # tokens per sequence the floor counts
    compiled_context: int         # the block bucket's context the compiler's count is for
    compiler_bytes: float | None  # the compiler's bytes accessed per step (None: not given)
    floor_bytes: float            # weight shards + every sequence's K/V at ``context``
    flops: float                  # the compiler's FLOPs per step (0: not given)
    tokens_per_s: float           # from the compiler's bytes (the floor's without them)
    floor_tokens_per_s: float     # from the floor: the most any engine could reach
    bound: str                    # "memory" or "compute"


@dataclasses.dataclass
class PlanReport:
    model: str
    target: str
    chip: str
    num_devices: int
    tensor_parallel_size: int
    dtype: str
    hbm_bytes: int                # per device: the compiler's budget (TPU) / memory (GPU)
    memory_utilization: float
    weight_bytes: int             # per device
    penalty_bytes: int            # per device (replicated penalty table)
    peak_temp_bytes: int          # largest temporary of the largest step, per device (the
    # part that does not grow with the cache)
    temp_bytes_per_block: float   # temporaries the step adds per KV block (> 0: it copies
    # the cache; see planner step 2)
    bytes_per_block: int          # one KV block, all layers, per device
    block_size: int
    num_kv_blocks: int            # planned (usable; the cache holds one more null block)
    max_model_len: int
    max_num_seqs: int
    # set by the planner's sizing (planner._size):
    fitting_kv_blocks: int = 0    # how many fit at memory_utilization (may be <= 0)
    kv_free_bytes_at_full_memory: int = 0  # what is left for KV at memory_utilization = 1.0
    fits: bool = False
    shortfall_bytes: int = 0      # > 0: how much more memory the configuration needs
    num_ladder_programs: int = 0  # every program an engine builds (its program set)
    num_ready_programs: int = 0   # the ready set: built before it takes requests
    buckets: str = "largest"      # which programs were compiled: "largest", "warmup", "all"
    probe_errors: list[str] = dataclasses.field(default_factory=list)
    platform: str = "tpu"         # the target's: "tpu" or "cuda"
    kv_layout: str = "fused"      # the cache layout planned (pallas_kernels.kv_layout)
    programs: list[ProgramResult] = dataclasses.field(default_factory=list)
    roofline: list[RooflineRow] = dataclasses.field(default_factory=list)
    roofline_inputs: list[tuple[tuple, dict[str, Any]]] = dataclasses.field(
        default_factory=list, repr=False)

    @property
    def kv_tokens(self) -> int:
        return max(self.num_kv_blocks, 0) * self.block_size

    @property
    def all_compiled(self) -> bool:
        return bool(self.programs) and all(p.compiled for p in self.programs)

    @property
    def growing_programs(self) -> list[ProgramResult]:
        """The programs whose temporaries grow with the KV cache (copies of it)."""
        return [p for p in self.programs if p.grows_with_cache]

    @property
    def ok(self) -> bool:
        """It fits, every program compiled, and (on TPUs, whose cache layout is meant to
        be updated in place at every shape, ``kv_layout``) no program copies the cache."""
        copies = self.platform == "tpu" and bool(self.growing_programs)
        return self.fits and self.all_compiled and not self.probe_errors and not copies

    def max_seqs_at(self, max_model_len: int) -> int:
        """Sequences of ``max_model_len`` tokens that the planned KV cache holds at once."""
        return self.kv_tokens // max_model_len

    def text(self) -> str:
        g = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        lines = [
            f"jaxpage plan: {self.model} on {self.target} ({self.num_devices} x {self.chip}), "
            f"tensor_parallel_size={self.tensor_parallel_size}, {self.dtype}",
            "Compiled for the target without its hardware; memory figures are the "
            "compiler's, speeds below are estimates.",
            "",
            "Per device:",
            f"  memory                {g(self.hbm_bytes)} (x memory_utilization "
            f"{self.memory_utilization} = {g(self.memory_utilization * self.hbm_bytes)})",
            f"  weights               {g(self.weight_bytes)}",
            f"  penalty table         {g(self.penalty_bytes)}",
            "  largest temporary     "
            + (g(self.peak_temp_bytes) if self.peak_temp_bytes or self.programs
               else "not probed (nothing fits)")
            + (f" + {self.temp_bytes_per_block / self.bytes_per_block:.2f} x the KV cache"
               if self.temp_bytes_per_block else ""),
            f"  KV block              {self.bytes_per_block / 2**20:.3f} MiB "
            f"({self.block_size} tokens, all layers; {self.kv_layout} layout)",
            f"  left for KV at 1.0    {g(max(self.kv_free_bytes_at_full_memory, 0))}"
            + ("" if self.kv_free_bytes_at_full_memory > 0 else
               f" (short by {g(-self.kv_free_bytes_at_full_memory)})"),
            "",
        ]
        if self.fits:
            lines += [
                f"KV cache: {self.num_kv_blocks} blocks = {self.kv_tokens} tokens "
                f"(room for {self.fitting_kv_blocks} at memory_utilization "
                f"{self.memory_utilization})",
                f"  max_model_len {self.max_model_len}: up to {self.max_seqs_at(self.max_model_len)}"
                f" full-length sequences at once (max_num_seqs={self.max_num_seqs})",
                f"  largest max_model_len x max_num_seqs that fits: {self.kv_tokens} tokens, "
                f"e.g. max_num_seqs={self.max_num_seqs} at max_model_len "
                f"{self.kv_tokens // max(self.max_num_seqs, 1)}",
            ]
        elif self.num_kv_blocks < 1:
            budget = self.memory_utilization * self.hbm_bytes
            lines += [
                f"DOES NOT FIT: the weights and the penalty table alone take "
                f"{g(self.weight_bytes + self.penalty_bytes)} of the {g(budget)} that "
                f"memory_utilization {self.memory_utilization} allows; with one KV block "
                f"it is short by {g(self.shortfall_bytes)} per device.",
                f"  At memory_utilization 1.0, {g(max(self.kv_free_bytes_at_full_memory, 0))} "
                f"would be left for the KV cache and the temporaries (at most "
                f"{max(self.kv_free_bytes_at_full_memory, 0) // self.bytes_per_block} blocks); "
                f"more devices (--tensor-parallel-size) or a larger chip leave room.",
            ]
        else:
            lines += [
                f"DOES NOT FIT: {self.num_kv_blocks} KV blocks asked for, room for "
                f"{max(self.fitting_kv_blocks, 0)} at memory_utilization "
                f"{self.memory_utilization}; short by {g(self.shortfall_bytes)} per device.",
            ]
        if self.temp_bytes_per_block:
            lines.append(
                f"WARNING: the compiled step's temporaries grow with the KV cache "
                f"({self.temp_bytes_per_block / self.bytes_per_block:.2f} bytes per byte of "
                f"cache): XLA copies the cache in each step instead of updating it in place. "
                f"The sizing above counts the copies; they also cost bandwidth every step.")
        growing = self.growing_programs
        if growing:
            lines.append(
                f"{'ERROR' if self.platform == 'tpu' else 'WARNING'}: {len(growing)} "
                f"program(s) hold temporaries that grow with the KV cache (a copy of it): "
                + ", ".join(p.label for p in growing))
        for error in self.probe_errors:
            lines.append(f"  probe failed: {error}")
        refused = [p for p in self.programs if not p.compiled]
        if refused:
            lines.append(f"The compiler refused {len(refused)} program(s); see below.")
        if self.programs:
            largest = max(self.programs, key=lambda p: p.device_bytes)
            lines.append(f"Largest compiled program: {largest.label}, "
                         f"{g(largest.device_bytes)} per device (arguments, outputs and "
                         f"temporaries; the chip has {g(self.hbm_bytes)})")
            done = sum(p.compiled for p in self.programs)
            what = {"warmup": "the ready set", "all": "every program",
                    "largest": "the largest bucket of each"}.get(self.buckets, self.buckets)
            lines += ["", f"Programs: {done} of {len(self.programs)} compiled ({what}) in "
                      f"{sum(p.seconds for p in self.programs):.1f} s; an engine builds "
                      f"{self.num_ready_programs} before it is ready (--buckets warmup) and "
                      f"{self.num_ladder_programs} in all (--buckets all)"]
            lines += [f"  {p.line()}" for p in self.programs]
        if self.roofline:
            lines += ["", "Roofline ESTIMATE of decode tokens/s (not measured; published "
                      "bandwidth and peak): compiler = the compiled step's bytes accessed "
                      "(every sequence at the compiled bucket's full context); floor = "
                      "weight shards + every sequence's K/V at the context. The compiler's "
                      "count includes each layer's KV scatter as a pass over the whole "
                      "cache (in-place updates are not modeled) and any cache copies, so "
                      "it overstates; the floor is the bound to compare a measurement with",
                      "  batch  context  compiler GiB/step  floor GiB/step  "
                      "tokens/s (compiler)  tokens/s (floor)  bound"]
            for r in self.roofline:
                compiler = ("    n/a" if r.compiler_bytes is None
                            else f"{r.compiler_bytes / GiB:7.2f}")
                over = (" (more tokens than the KV cache holds: lower --context)"
                        if r.batch * r.context > self.kv_tokens else "")
                lines.append(f"  {r.batch:5d}  {r.context:7d}  {compiler:>17}  "
                             f"{r.floor_bytes / GiB:14.2f}  {r.tokens_per_s:19.0f}  "
                             f"{r.floor_tokens_per_s:16.0f}  {r.bound}{over}")
        return "\n".join(lines)
