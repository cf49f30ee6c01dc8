"""Engine configuration as frozen dataclasses, each checked in ``__post_init__``.

Every component takes only its own sub-config. The defaults here are mirrored in
``configs/engine.toml`` (a test keeps the two in step); ``EngineConfig.from_toml``
reads such a file, and keyword arguments override it.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from jaxpage.checks import require
from jaxpage.speculative_config import SpeculativeConfig

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
SUPPORTED_ATTENTION_BACKENDS = ("auto", "reference", "cpu", "gpu", "tpu")
SUPPORTED_LOAD_FORMATS = ("auto", "safetensors", "gguf")


def cache_dir() -> str:
    """jaxpage's cache directory: ``$JAXPAGE_CACHE_DIR``, default ``~/.cache/jaxpage``
    (converted weights, tokenizers, compiled programs, C++ kernels live under it)."""
    return os.environ.get("JAXPAGE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxpage")


# jaxpage's own modes, then the pre-quantized checkpoint methods (checked against the
# checkpoint: ``jaxpage.models.prequantized``), vLLM's kernel-specific aliases included
SUPPORTED_QUANTIZATION = (None, "int8", "int4", "gguf", "compressed-tensors", "fp8", "awq",
                          "gptq", "awq_marlin", "gptq_marlin")
SUPPORTED_KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how to run it numerically."""

    # None: the embedded default (SmolLM2-135M-Instruct GGUF); a local directory or .gguf
    # file; "preset:<name>"; or a Hugging Face Hub id, resolved through the standard cache
    # (``models.hub``: ``revision``, ``download_dir``, ``HF_HUB_OFFLINE``)
    model: str | None = None
    tokenizer: str | None = None  # None: the model's own tokenizer
    revision: str | None = None  # Hub id: a branch, tag or commit (None: main)
    download_dir: str | None = None  # Hub id: the cache to use (None: the standard one)
    # What to read: "auto" (what the path holds), "safetensors" or "gguf" (checked against it)
    load_format: str = "auto"
    # "auto": the checkpoint's dtype on GPUs and TPUs (bfloat16 when it names none), and
    # float32 on the CPU, which measures fastest there; or float32, bfloat16, float16
    dtype: str = "auto"
    # Sampling defaults for requests that set none (``engine.startup.generation_config``): "auto"
    # the checkpoint's generation_config.json, "vllm" none, or a directory holding one
    generation_config: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    attention_backend: str = "auto"
    compilation_cache: bool = True  # save compiled programs under the jaxpage cache dir
    weight_cache: bool = True  # keep GGUF weights converted under the jaxpage cache dir
    # Programs built at start-up (``engine.startup.warmup``): True every program; "ready" the few
    # that run any batch padded, the rest in the background; "core" a full prefill step
    # and the decode programs, unless saved; False none; None: "ready" on accelerators,
    # "core" on the CPU ($JAXPAGE_WARMUP overrides this default).
    warmup: bool | str | None = None
    # Keys replaced in the model's Hugging Face config before it is built (vLLM's name), e.g.
    # {"num_hidden_layers": 2} for a shallow copy of a model; not for orbax checkpoints.
    hf_overrides: dict | None = None
    # Quantization: None (a float checkpoint as stored; a pre-quantized one,
    # compressed-tensors / fp8 / AWQ / GPTQ, as it says), "int8", "int4" (grouped,
    # weight-only), "fp8" (per channel, W8A8 on FP8 GPUs), "gguf" (a GGUF file's Q8_0 /
    # Q4_0 / Q4_1 blocks kept as stored); a pre-quantized checkpoint's method may be named,
    # and must then match it
    quantization: str | None = None
    # int8 / int4: input rows per scale (None: 32); 0: per channel
    quantization_group_size: int | None = None
    # Multi-LoRA serving (``docs/lora.md``): adapters in PEFT's format, at most
    # ``max_loras`` of them on the device at once (one batch may mix them all), each of
    # rank <= ``max_lora_rank``; ``max_cpu_loras`` adapters kept loaded in host memory
    # (None: unbounded), least recently used dropped first.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.enable_lora, bool),
                f"enable_lora={self.enable_lora!r} must be a bool")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"{name}={value!r} must be an integer >= 1")
        require(self.max_cpu_loras is None
                or (isinstance(self.max_cpu_loras, int) and not isinstance(self.max_cpu_loras, bool)
                    and self.max_cpu_loras >= self.max_loras),
                f"max_cpu_loras={self.max_cpu_loras!r} must be None or an integer >= "
                f"max_loras={self.max_loras}")
        require(self.quantization in SUPPORTED_QUANTIZATION,
                f"quantization={self.quantization!r} is not supported; choose one of "
                f"{SUPPORTED_QUANTIZATION}")
        require(self.quantization_group_size is None
                or (isinstance(self.quantization_group_size, int)
                    and not isinstance(self.quantization_group_size, bool)
                    and (self.quantization_group_size == 0
                         or self.quantization_group_size >= 2)),
                f"quantization_group_size={self.quantization_group_size!r} must be None (the "
                "mode's default), 0 (one scale per output channel) or an integer >= 2")
        require(self.hf_overrides is None or (isinstance(self.hf_overrides, dict)
                                              and all(isinstance(k, str)
                                                      for k in self.hf_overrides)),
                f"hf_overrides={self.hf_overrides!r} must be None or a dict with string keys")
        require(self.dtype in SUPPORTED_DTYPES,
                f"dtype={self.dtype!r} is not supported; choose one of {SUPPORTED_DTYPES}")
        require(self.load_format in SUPPORTED_LOAD_FORMATS,
                f"load_format={self.load_format!r} is not supported; choose one of "
                f"{SUPPORTED_LOAD_FORMATS}")
        for name in ("revision", "download_dir"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and value),
                    f"{name}={value!r} must be None or a non-empty string")
        require(isinstance(self.generation_config, str) and self.generation_config,
                f"generation_config={self.generation_config!r} must be 'auto', 'vllm' or a "
                f"directory")
        require(self.max_model_len is None
                or (isinstance(self.max_model_len, int) and self.max_model_len >= 2),
                f"max_model_len={self.max_model_len!r} must be None or an integer >= 2")
        require(isinstance(self.seed, int), f"seed={self.seed!r} must be an integer")
        require(self.warmup is None or isinstance(self.warmup, bool)
                or self.warmup in ("ready", "core"),
                f"warmup={self.warmup!r} must be None (auto), True, False, 'ready' or 'core'")
        require(isinstance(self.compilation_cache, bool),
                f"compilation_cache={self.compilation_cache!r} must be a bool")
        require(isinstance(self.weight_cache, bool),
                f"weight_cache={self.weight_cache!r} must be a bool")
        require(self.attention_backend in SUPPORTED_ATTENTION_BACKENDS,
                f"attention_backend={self.attention_backend!r} is not one of "
                f"{SUPPORTED_ATTENTION_BACKENDS}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. ``num_kv_blocks`` excludes the reserved null block 0."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory
    kv_cache_memory: int = 2 * 1024**3  # bytes for the KV cache on devices without memory stats
    memory_utilization: float = 0.9  # share of device memory jaxpage may use (devices with stats)
    enable_prefix_caching: bool = True
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    # Disaggregated serving (``docs/disaggregated.md``): None, "prefill" (offers finished
    # prompts' KV pages to a decode instance) or "decode" (takes requests whose prompt a
    # prefill instance ran, pulling their pages); ``kv_transfer_timeout``: seconds a
    # decode instance waits for one request's pages.
    kv_role: str | None = None
    kv_transfer_timeout: float = 30.0
    # "auto": the model dtype; "int8", "fp8" (= "fp8_e4m3") or "fp8_e5m2": one byte per
    # element, scaled per layer, KV head and channel (``docs/quantization.md``)
    kv_cache_dtype: str = "auto"

    @property
    def kv_format(self) -> str | None:
        """The byte format of the KV cache (``pallas_kernels.kv_quant``), None for floats."""
        return {"auto": None, "fp8": "fp8_e4m3"}.get(self.kv_cache_dtype, self.kv_cache_dtype)

    def __post_init__(self) -> None:
        require(self.kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES,
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of "
                f"{SUPPORTED_KV_CACHE_DTYPES}")
        require(isinstance(self.block_size, int) and self.block_size >= 1
                and self.block_size & (self.block_size - 1) == 0,
                f"block_size={self.block_size!r} must be a positive power of two")
        require(self.num_kv_blocks is None
                or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1),
                f"num_kv_blocks={self.num_kv_blocks!r} must be None or an integer >= 1")
        require(isinstance(self.kv_cache_memory, int) and self.kv_cache_memory > 0,
                f"kv_cache_memory={self.kv_cache_memory!r} must be a positive number of bytes")
        require(isinstance(self.memory_utilization, (int, float))
                and 0 < self.memory_utilization <= 1,
                f"memory_utilization={self.memory_utilization!r} must be in (0, 1]")
        require(isinstance(self.enable_prefix_caching, bool),
                f"enable_prefix_caching={self.enable_prefix_caching!r} must be a bool")
        require(isinstance(self.swap_space, (int, float)) and self.swap_space >= 0,
                f"swap_space={self.swap_space!r} must be a number of GiB >= 0")
        require(self.kv_role in (None, "prefill", "decode"),
                f"kv_role={self.kv_role!r} must be None, 'prefill' or 'decode'")
        require(isinstance(self.kv_transfer_timeout, (int, float)) and self.kv_transfer_timeout > 0,
                f"kv_transfer_timeout={self.kv_transfer_timeout!r} must be a positive number "
                "of seconds")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-iteration limits of the continuous-batching scheduler."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    scheduling_policy: str = "fcfs"  # or "priority" (lower value first, with aging)
    priority_aging_steps: int = 64   # steps of waiting that improve priority by 1
    preemption_mode: str = "auto"    # "recompute", "swap" or "auto" (cheaper per request)
    long_prefill_token_threshold: int = 0  # > 0: most prompt tokens one request takes a step
    num_scheduler_steps: int = 8  # decode iterations run on device per call when all decode
    async_scheduling: bool = True  # dispatch the next call before the last one's tokens are processed
    # On the CPU backend, the nice value given to XLA's compute threads (``runtime.
    # cpu_threads``): the host loop, which overlaps the device step, gets a core first.
    # 0 leaves them at the process's priority.
    cpu_compute_niceness: int = 10
    # Build the decode programs a running batch drains into on a background thread while
    # the device runs; None: on accelerators only (on a CPU the compiler and the step share
    # the same cores, and measured no faster).
    compile_ahead: bool | None = None
    max_waiting_requests: int | None = None  # server: more waiting than this is a 503; None: no cap
    # Factor between neighbouring rungs of the bucket ladders (tokens, sequences, blocks per
    # sequence): 2 pads a batch by less than 2x; a larger factor compiles fewer programs
    # (each ladder keeps its smallest and largest rung) at the cost of more padding.
    bucket_growth: int = 2
    # vLLM's ``speculative_config`` (a dict, see ``SpeculativeConfig``); None: no speculation.
    speculative_config: dict | None = None

    @property
    def speculative(self) -> "SpeculativeConfig | None":
        """The checked speculative-decoding settings, or None."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def __post_init__(self) -> None:
        require(self.speculative_config is None or isinstance(self.speculative_config, dict),
                f"speculative_config={self.speculative_config!r} must be None or a dict "
                "such as {'method': 'ngram', 'num_speculative_tokens': 4}")
        self.speculative  # noqa: B018 (checks the dict: a ValueError names what is wrong)
        require(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
                f"max_num_seqs={self.max_num_seqs!r} must be an integer >= 1")
        require(isinstance(self.max_num_batched_tokens, int)
                and self.max_num_batched_tokens >= 1,
                f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be an integer >= 1")
        require(self.max_num_batched_tokens >= self.max_num_seqs,
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} (every running sequence needs a token slot)")
        require(self.scheduling_policy in ("fcfs", "priority"),
                f"scheduling_policy={self.scheduling_policy!r} must be 'fcfs' or 'priority'")
        require(isinstance(self.priority_aging_steps, int) and self.priority_aging_steps >= 1,
                f"priority_aging_steps={self.priority_aging_steps!r} must be an integer >= 1")
        require(self.preemption_mode in ("recompute", "swap", "auto"),
                f"preemption_mode={self.preemption_mode!r} must be 'recompute', 'swap' or 'auto'")
        require(isinstance(self.num_scheduler_steps, int) and self.num_scheduler_steps >= 1,
                f"num_scheduler_steps={self.num_scheduler_steps!r} must be an integer >= 1")
        require(isinstance(self.async_scheduling, bool),
                f"async_scheduling={self.async_scheduling!r} must be a bool")
        require(isinstance(self.cpu_compute_niceness, int)
                and not isinstance(self.cpu_compute_niceness, bool)
                and 0 <= self.cpu_compute_niceness <= 19,
                f"cpu_compute_niceness={self.cpu_compute_niceness!r} must be an integer "
                "in 0..19 (0 leaves XLA's CPU threads alone)")
        require(self.compile_ahead is None or isinstance(self.compile_ahead, bool),
                f"compile_ahead={self.compile_ahead!r} must be None (auto), True or False")
        require(self.max_waiting_requests is None
                or (isinstance(self.max_waiting_requests, int)
                    and not isinstance(self.max_waiting_requests, bool)
                    and self.max_waiting_requests >= 1),
                f"max_waiting_requests={self.max_waiting_requests!r} must be None or an "
                "integer >= 1")
        require(isinstance(self.bucket_growth, int) and not isinstance(self.bucket_growth, bool)
                and self.bucket_growth >= 2,
                f"bucket_growth={self.bucket_growth!r} must be an integer >= 2")
        require(isinstance(self.long_prefill_token_threshold, int)
                and self.long_prefill_token_threshold >= 0,
                f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} must be "
                "an integer >= 0 (0 disables it)")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices and processes (see docs/parallel.md).

    ``tensor_parallel_size`` devices hold one replica (Megatron-style sharding);
    ``data_parallel_size`` replicas run on disjoint device groups behind one router.
    With ``num_processes > 1`` every process runs the same command and joins through
    ``jax.distributed.initialize(coordinator_address, num_processes, process_id)``.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    coordinator_address: str | None = None  # "host:port" of process 0; None: one process
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "num_processes"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"{name}={value!r} must be an integer >= 1")
        require(isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes,
                f"process_id={self.process_id!r} must be an integer in [0, num_processes="
                f"{self.num_processes})")
        require(self.coordinator_address is None
                or (isinstance(self.coordinator_address, str)
                    and self.coordinator_address.rpartition(":")[2].isdigit()),
                f"coordinator_address={self.coordinator_address!r} must be 'host:port'")
        require(self.num_processes == 1 or self.coordinator_address is not None,
                f"num_processes={self.num_processes} needs a coordinator_address ('host:port' "
                "of process 0)")
        require(self.num_processes == 1 or self.data_parallel_size == 1,
                f"data_parallel_size={self.data_parallel_size} with num_processes="
                f"{self.num_processes} is not supported: use tensor parallelism across processes")


SECTIONS = ("model", "cache", "scheduler", "parallel")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (the ``LLM(...)`` surface).

        Unknown names raise ``ValueError`` listing the accepted ones.
        """
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                    "parallel": ParallelConfig}
        owner = {f.name: name for name, sub in sections.items() for f in dataclasses.fields(sub)}
        unknown = sorted(set(kwargs) - set(owner))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; accepted: {sorted(owner)}")
        grouped: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in kwargs.items():
            grouped[owner[key]][key] = value
        return cls(**{name: sections[name](**grouped[name]) for name in sections})

    @classmethod
    def from_toml(cls, path: str, **overrides: Any) -> "EngineConfig":
        """Read a TOML file with ``[model]``, ``[cache]``, ``[scheduler]``, ``[parallel]`` tables."""
        return cls.from_kwargs(**{**load_toml_options(path), **overrides})


def load_toml_options(path: str) -> dict[str, Any]:
    """Flat engine options from a TOML file's tables (``[model]``, ``[cache]``, ...)."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {unknown}; expected {', '.join(SECTIONS)}")
    flat: dict[str, Any] = {}
    for table in data.values():
        flat.update(table)
    return flat
