"""XLA options of the decode programs (``runtime.compiler_options``): on GPUs the dot
merger joins the MLP's gate and up projections into one GEMM in multi-step decode
programs, whose weights are past XLA's default 32 MB; other programs and platforms keep
XLA's defaults."""

from __future__ import annotations

import re

import pytest

from jaxpage.config import EngineConfig
from jaxpage.parallel.targets import target_devices
from jaxpage.planning.abstract_engine import AbstractEngine
from jaxpage.runtime.compiler_options import ENV_DECODE_DOT_MERGER, decode_compiler_options


def test_only_gpu_decode_programs_get_options(monkeypatch):
    monkeypatch.delenv(ENV_DECODE_DOT_MERGER, raising=False)
    assert decode_compiler_options("cpu") is None and decode_compiler_options("tpu") is None
    options = decode_compiler_options("gpu")
    assert options["xla_gpu_dot_merger_threshold_mb"] * 2**20 > 8192 * 28672 * 2  # 70B's gate
    monkeypatch.setenv(ENV_DECODE_DOT_MERGER, "32")     # XLA's default: the merge off
    assert decode_compiler_options("gpu") == {"xla_gpu_dot_merger_threshold_mb": 32}
    for bad in ("lots", "-1", "1.5"):
        monkeypatch.setenv(ENV_DECODE_DOT_MERGER, bad)
        with pytest.raises(ValueError, match=f"{ENV_DECODE_DOT_MERGER}='{re.escape(bad)}'"):
            decode_compiler_options("gpu")


def _gemm_widths(hlo: str) -> list[int]:
    """The last output dimension of every GEMM fusion of a compiled module."""
    return [int(w) for w in re.findall(r"%gemm_fusion[\w.]* = \S*?\[(?:\d+,)*(\d+)\]", hlo)]


def test_an_h100_decode_program_runs_gate_and_up_as_one_gemm(monkeypatch):
    """One layer of Llama-3-8B (gate and up 4,096 x 14,336: 117 MB each in bfloat16)
    compiled for an H100: the decode loop has a GEMM 28,672 wide (gate and up) and none
    14,336 wide; the single step of the same bucket keeps two (XLA's default)."""
    config = EngineConfig.from_kwargs(model="preset:llama3-8b",
                                      hf_overrides={"num_hidden_layers": 1}, max_num_seqs=16,
                                      max_model_len=256, num_scheduler_steps=2)
    monkeypatch.delenv(ENV_DECODE_DOT_MERGER, raising=False)
    engine = AbstractEngine(config, target_devices("h100"), num_kv_blocks=64)
    shape = engine.builder.decode_shapes()[0]
    decode = _gemm_widths(engine.compile(engine.decode_program(shape)).as_text())
    assert 2 * 14336 in decode and 14336 not in decode, decode
    step = _gemm_widths(engine.compile(engine.step_program(shape)).as_text())
    assert step.count(14336) >= 2 and 2 * 14336 not in step, step
