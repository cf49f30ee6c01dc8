"""XLA options the engine compiles some of its programs with, per platform.

Decode programs on GPUs: XLA's dot merger joins the projections that read the same
activations into one GEMM (one kernel reading their weights one after the other), but
only dots under ``xla_gpu_dot_merger_threshold_mb`` (32 MB by default). Llama-3-8B's
q / k / v projections are under it and become one GEMM; its MLP's gate and up (117 MB
each in bfloat16) are not, so every layer ran two GEMMs and a split-K partial sum each
where one would do (the deviceless H100 compile of the decode step:
``scripts/step_kernels.py``, 16 kernels a layer; 15 with this option). A decode step's
GEMMs have a few rows (``max_num_seqs`` at most) and are bound by reading the weights, so
one kernel over both weights costs one launch and one tail less.

Prefill and mixed programs keep XLA's default: their GEMMs are compute-bound, and a
merged dot whose weights cuBLAS takes would first be copied into one array every step
(XLA fuses the concatenation into its own Triton GEMMs only). A decode step's merged GEMM
is a Triton GEMM in the deviceless compile (which does not autotune); on a device the
autotuner could still choose cuBLAS and that copy. Compiled, not timed: the batch-1
variant ``mlp_unmerged`` of ``scripts/accelerator_check.sh`` (this option off) measures it
against the default on the next lent GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

# Large enough for any dense model's projections (Llama-3-70B's gate, 8192 x 28672 in
# bfloat16, is 448 MB).
DECODE_DOT_MERGER_MB = 4096
# Overrides it (an integer of MB; 32, XLA's default, turns the merge of the MLP's GEMMs
# off): for measuring the merge on a GPU. Part of the executable cache's fingerprint.
ENV_DECODE_DOT_MERGER = "JAXPAGE_GPU_DECODE_DOT_MERGER_MB"


def decode_compiler_options(platform: str) -> dict[str, int] | None:
    """``jax.jit``'s ``compiler_options`` for multi-step decode programs on ``platform``
    ("cpu", "gpu", "tpu"): None (XLA's defaults) except on GPUs."""
    if platform != "gpu":
        return None
    text = os.environ.get(ENV_DECODE_DOT_MERGER, "").strip()
    try:
        megabytes = int(text) if text else DECODE_DOT_MERGER_MB
    except ValueError:
        megabytes = -1
    if megabytes < 0:
        raise ValueError(f"{ENV_DECODE_DOT_MERGER}={text!r} must be a whole number of MB")
    return {"xla_gpu_dot_merger_threshold_mb": megabytes}


def decode_jit(jit: Callable, platform: str) -> Callable:
    """``jit`` (``jax.jit`` or ``Placement.jit``) with the decode programs' options for
    ``platform``: what the engine and ``jaxpage plan``'s abstract engine both jit decode
    loops with."""
    options = decode_compiler_options(platform)
    return jit if options is None else functools.partial(jit, compiler_options=options)
