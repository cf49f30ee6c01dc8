"""The engine's own programs compiled for real targets without the hardware (``plan``).

``jaxpage.plan`` builds every program the model runner runs (steps per bucket, the
multi-step decode loop, block moves (copies and swaps), the penalty fill) with abstract
parameters and KV cache sharded over the target's devices, and compiles them with
libtpu / the CUDA plugin. A model step takes 20-80 s to compile on a 2-core CI machine
(XLA's own compile of the unrolled layers; the Pallas kernels are ~2 s of it), so the
ladders here are the smallest that still have every kind of bucket, Llama-3-8B compiles
the largest bucket of each program with a given cache size (no memory probe), and its
token budget equals its sequence count so that the largest step is also the all-decode
step the roofline reads.

Compile time grows with the number of (identical) layers, so the default suite compiles
every target with the models' first 4 layers (``hf_overrides``): the same layer program,
Pallas kernels, shardings and memory probe, at an eighth of the time. The full-depth
compiles (30 layers of SmolLM2, 32 of Llama-3-8B) are the same tests marked slow.
"""

from __future__ import annotations

import pytest

from jaxpage import plan

GiB = 2**30
SHALLOW = {"num_hidden_layers": 4}
SMALL_LADDERS = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128,
                     num_scheduler_steps=4, swap_space=0.0005)


def _swap_scaled(options, depth, *, full_depth):
    """``options`` with the swap space shrunk with the depth: a KV block's bytes grow with
    the layers, so the same swap space then holds the same number of blocks (the swap
    programs compiled are the same at every depth)."""
    layers = (depth or {}).get("num_hidden_layers", full_depth)
    return dict(options, swap_space=options["swap_space"] * layers / full_depth)


def _assert_compiled_and_fits(report):
    failed = [p.line() for p in report.programs if not p.compiled]
    assert not failed and not report.probe_errors, (failed, report.probe_errors)
    assert report.fits and report.num_kv_blocks >= 1
    assert report.roofline, "an all-decode step is compiled, so the roofline has a row"
    names = {p.label.split("[")[0].split("(")[0] for p in report.programs}
    assert {"step", "decode4", "move_blocks", "penalty_fill"} <= names
    # every program's arguments + temporaries fit the device, as the compiler sized them
    assert max(p.device_bytes for p in report.programs) <= report.hbm_bytes
    # each program compiled again at half the cache: none holds a copy of it
    assert all(p.temp_bytes_per_block is not None for p in report.programs)
    assert not report.growing_programs, [p.line() for p in report.growing_programs]
    assert report.ok


@pytest.mark.parametrize("depth", [  # ~85 s on 2 cores: both slow; the default suite plans
    # one v5e chip through the pre-quantized W8A8 case below, and TP on TPUs through the
    # few-KV-heads case
    pytest.param(SHALLOW, id="4-layers", marks=pytest.mark.slow),
    pytest.param(None, id="30-layers", marks=pytest.mark.slow)])
def test_smollm2_on_one_v5e_chip_sized_by_the_compiler(depth):
    """The path a user takes: probe the largest step, size the cache, compile the rest."""
    report = plan(None, "v5e:1x1", hf_overrides=depth,
                  **_swap_scaled(SMALL_LADDERS, depth, full_depth=30))
    _assert_compiled_and_fits(report)
    # the ready set (the largest step, decode call and block move, the penalty fill) and
    # the roofline's all-decode step; a block move holds at most the 17 blocks' power of two
    assert [p.label for p in report.programs] == [
        "step[16, 2, 8]", "step[2, 2, 8]", "decode4[2, 2, 8]", "move_blocks[32]",
        "penalty_fill[512]"]
    # steps (2, 2) and (16, 2) (additive: a step of T tokens seats min(T, 2)), one decode
    # call, block moves of 1, 4, 16 and 32, the penalty fill
    assert report.num_ladder_programs == 8 and report.num_ready_programs == 4
    assert ("an engine builds 4 before it is ready (--buckets warmup) and 8 in all"
            in report.text())
    assert 0 < report.peak_temp_bytes < report.weight_bytes
    assert report.num_kv_blocks == 2 * 8            # capped at what 2 full sequences use
    assert report.fitting_kv_blocks > 10_000        # a 135M model leaves most of 16 GiB
    assert report.roofline[0].batch == 2 and report.roofline[0].compiler_bytes > 0


@pytest.mark.slow
def test_smollm2_every_bucket_on_one_v5e_chip():
    report = plan(None, "v5e:1x1", buckets="all", **SMALL_LADDERS)
    _assert_compiled_and_fits(report)
    # 2 sequences, 16 tokens, 128 context (8 blocks, one rung): steps (T, S) = (16, 2),
    # (2, 2); the decode loop (2, 2); block moves of 1, 4, 16, 32; the penalty fill. The
    # ready set first, then the rest largest first
    labels = [p.label for p in report.programs]
    assert labels == ["step[16, 2, 8]", "decode4[2, 2, 8]", "move_blocks[32]",
                      "penalty_fill[512]", "step[2, 2, 8]", "move_blocks[16]",
                      "move_blocks[4]", "move_blocks[1]"]
    assert report.num_ladder_programs == len(labels)
    assert report.weight_bytes < 0.5 * GiB          # 135M parameters in bfloat16
    assert report.num_kv_blocks == 2 * 8            # capped at what 2 full sequences use


@pytest.mark.parametrize("target,tp,layers", [
    # the TPU cases compile for 55-100 s on 2 cores: slow; the default suite's TPU plans
    # are the few-KV-heads case (TP 8 on a v5e slice) and the pre-quantized v5e chip
    pytest.param("v5e:2x4", 8, 4, marks=pytest.mark.slow),
    pytest.param("v6e:1x1", 1, 4, marks=pytest.mark.slow), ("h100", 1, 4),
    *(pytest.param(target, tp, 32, marks=pytest.mark.slow)
      for target, tp in (("v5e:2x4", 8), ("v6e:1x1", 1), ("h100", 1)))])
def test_llama3_8b_largest_buckets(target, tp, layers):
    depth = {"num_hidden_layers": layers}
    options = dict(_swap_scaled(SMALL_LADDERS, depth, full_depth=32),
                   max_num_batched_tokens=SMALL_LADDERS["max_num_seqs"])
    report = plan("preset:llama3-8b", target, buckets="largest", tensor_parallel_size=tp,
                  num_kv_blocks=1024, hf_overrides=depth, **options)
    _assert_compiled_and_fits(report)
    assert report.tensor_parallel_size == tp
    # the ready set (on a GPU its step and decode call decide sampling on the device, and
    # the roofline's host-decided all-decode step is added); 1,025 blocks: moves of 512
    device = "(device-decided)" if target == "h100" else ""
    assert [p.label for p in report.programs] == [
        f"step{device}[2, 2, 8]", *(["step[2, 2, 8]"] if device else []),
        f"decode4{device}[2, 2, 8]", f"move_blocks[{512 if layers == 4 else 64}]",
        "penalty_fill[512]"]
    # bfloat16 parameters split over tp devices: the two vocab tables, the final norm and
    # 218.1 M per layer (8.03 B at 32 layers, 14.96 GiB)
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    expected = 2 * (2 * 128256 * 4096 + 4096 + layers * per_layer)
    assert abs(report.weight_bytes * tp - expected) < 0.001 * expected
    if layers == 32:
        assert abs(report.weight_bytes * tp / GiB - 14.96) < 0.1


def test_llama3_8b_does_not_fit_one_v5e_chip(capsys):
    """15 GiB of bfloat16 weights in a chip whose compiler budget is 15.75 GiB: at the
    default memory_utilization 0.9 nothing is left, and plan says so (no compile needed),
    through the Python API and through the CLI's exit status."""
    report = plan("preset:llama3-8b", "v5e:1x1")
    assert not report.fits and not report.ok and report.num_kv_blocks == 0
    assert not report.programs
    # weights + penalty table + one block + the null block, past 0.9 x 15.75 GiB
    budget = 0.9 * 15.75 * GiB
    expected = report.weight_bytes + report.penalty_bytes + 2 * report.bytes_per_block - budget
    assert abs(report.shortfall_bytes - expected) < 2**20
    assert 0.7 * GiB < report.kv_free_bytes_at_full_memory < 0.8 * GiB
    assert "DOES NOT FIT" in report.text()

    from jaxpage.cli import main

    assert main(["plan", "--model", "preset:llama3-8b", "--target", "v5e:1x1"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_plan_rejects_unknown_targets_and_options():
    with pytest.raises(ValueError, match="target='v9z:2x2'"):
        plan(None, "v9z:2x2")
    with pytest.raises(ValueError, match="target='h100x9'"):
        plan(None, "h100x9")
    with pytest.raises(ValueError, match="tensor_parallel_size=8 needs 8 devices"):
        plan("preset:llama3-8b", "v5e:1x1", tensor_parallel_size=8)
    with pytest.raises(ValueError, match="unknown engine option"):
        plan(None, "v5e:1x1", max_num_sequences=4)
    with pytest.raises(ValueError, match="buckets='some'"):
        plan(None, "v5e:1x1", buckets="some")


@pytest.mark.slow  # ~60 s each; the step it extends compiles in the default suite
@pytest.mark.parametrize("target", ["v5e:1x1", "h100"])
def test_speculative_verify_step_compiles(target):
    """The verify step of speculative decoding (every token sampled and checked), for a
    TPU and a GPU, with the Pallas attention kernels of each."""
    report = plan(None, target, buckets="largest", hf_overrides=SHALLOW,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "disable_by_batch_size": 2},
                  **_swap_scaled(SMALL_LADDERS, SHALLOW, full_depth=30))
    _assert_compiled_and_fits(report)
    labels = [p.label for p in report.programs]
    # 2 rows with up to 3 proposals each: at most 8 tokens (the 16-token budget allows it);
    # a GPU's ready set holds its device-decided variant (the host picks the others)
    wanted = "verify(device-decided)[8, 2, 8]" if target == "h100" else "verify[8, 2, 8]"
    assert wanted in labels, labels


def test_block_moves_stop_at_one_chunk_of_blocks():
    """Block moves (copies and swaps) grow by 4 and stop at ``SWAP_CHUNK_BYTES`` of blocks: a whole-cache gather did not fit the
    chip next to the cache (libtpu: 19.5 GB of temporaries for SmolLM2 on v5e)."""
    from jaxpage.config import EngineConfig
    from jaxpage.parallel.targets import target_devices
    from jaxpage.planning.abstract_engine import AbstractEngine
    from jaxpage.runtime.block_ops import swap_chunk

    config = EngineConfig.from_kwargs(model=None, dtype="bfloat16")
    engine = AbstractEngine(config, target_devices("v5e:1x1"), num_kv_blocks=11012)
    chunk = swap_chunk(engine.bytes_per_block(per_device=False))
    assert chunk == 256  # 0.35 MiB blocks, 128 MiB per call
    moves = [k.bucket[0] for k in engine.program_set().all if k.kind == "move_blocks"]
    assert sorted(moves) == [1, 4, 16, 64, 256]


@pytest.mark.slow  # ~60 s each; the step it extends compiles in the default suite
@pytest.mark.parametrize("target", ["v5e:1x1", "h100"])
def test_lora_programs_compile(target):
    """With adapter slots every program takes them: steps of 2 tokens (fewer than the 4
    slots: each token gathers its adapter) and of 16 (masked), the decode loop."""
    report = plan(None, target, buckets="all", hf_overrides=SHALLOW, enable_lora=True,
                  max_loras=4, max_lora_rank=16,
                  **_swap_scaled(SMALL_LADDERS, SHALLOW, full_depth=30))
    _assert_compiled_and_fits(report)
    labels = [p.label for p in report.programs]
    assert {"step[2, 2, 8]", "step[16, 2, 8]", "decode4[2, 2, 8]"} <= set(labels), labels


def test_a_program_growing_with_the_cache_fails_a_tpu_plan_only():
    """What ``jaxpage plan`` exits non-zero on: a TPU program that copies the cache."""
    from jaxpage.planning.report import PlanReport, ProgramResult

    def report(platform, growing):
        r = PlanReport(model="m", target="t", chip="c", num_devices=1, tensor_parallel_size=1,
                       dtype="bfloat16", hbm_bytes=GiB, memory_utilization=0.9,
                       weight_bytes=0, penalty_bytes=0, peak_temp_bytes=0,
                       temp_bytes_per_block=0.0, bytes_per_block=1000, block_size=16,
                       num_kv_blocks=10, max_model_len=128, max_num_seqs=2, fits=True,
                       platform=platform)
        r.programs = [ProgramResult("step[8, 2, 8]", True, temp_bytes_per_block=2000.0,
                                    grows_with_cache=growing),
                      ProgramResult("move_blocks[4]", True, temp_bytes_per_block=0.0)]
        return r

    assert report("tpu", False).ok and report("cuda", True).ok
    bad = report("tpu", True)
    assert not bad.ok
    assert "ERROR: 1 program(s) hold temporaries that grow with the KV cache" in bad.text()
    assert "GROW with the KV cache by 2000 bytes per block" in bad.text()


@pytest.mark.slow  # ~60 s on 2 cores
def test_int8_kv_with_token_scales_plans_for_an_h100():
    """An int8 cache on a GPU keeps a scale code per token and KV head beside K and V
    (``kv_token_scale``): every program compiles with them, none copies the cache (its
    four arrays), and a block's bytes count the codes."""
    depth = {"num_hidden_layers": 4}
    options = dict(_swap_scaled(SMALL_LADDERS, depth, full_depth=32),
                   max_num_batched_tokens=SMALL_LADDERS["max_num_seqs"])
    report = plan("preset:llama3-8b", "h100", buckets="largest", num_kv_blocks=1024,
                  hf_overrides=depth, kv_cache_dtype="int8", **options)
    _assert_compiled_and_fits(report)
    assert report.kv_layout == "split"
    block_size = 16
    assert report.bytes_per_block == 4 * block_size * 8 * (2 * 128 + 2)  # 4 layers, 8 heads
    assert report.block_size == block_size


FEW_KV_HEADS = {  # one device's share: (target, tensor parallel, overrides, kv_cache_dtype)
    "d64-1head-tp8-bf16": ("v5e:2x4", 8, dict(hidden_size=2048, num_attention_heads=32,
                                               num_key_value_heads=8), "auto"),
    "d256-1head-tp8-fp8": ("v6e:2x2", 4, dict(hidden_size=2048, num_attention_heads=8,
                                               num_key_value_heads=4), "fp8"),
    "d128-2heads-tp4-int8": ("v5p:2x2x1", 4, dict(num_key_value_heads=8), "int8"),
}


@pytest.mark.parametrize("case", [  # ~100 s each on 2 cores: one in the default suite
    "d64-1head-tp8-bf16", *(pytest.param(case, marks=pytest.mark.slow)
                            for case in list(FEW_KV_HEADS)[1:])])
def test_few_kv_heads_per_device_update_the_cache_in_place(case):
    """The shapes whose old layout XLA:TPU copied in every program (1-2 KV heads of 64,
    128 or 256 lanes per device, float and byte caches): every program's temporaries stay
    constant as the cache doubles, and the plan passes (``kv_layout``'s fused rows). Four
    layers: at two, the d64 step's temporaries moved by 629 bytes per block (7.7% of a
    2-layer block of 8 KiB, not a copy of it, which would be 100%), over the 5% bound."""
    target, tp, overrides, kv_dtype = FEW_KV_HEADS[case]
    depth = dict(overrides, num_hidden_layers=4)
    options = dict(_swap_scaled(SMALL_LADDERS, depth, full_depth=32),
                   max_num_batched_tokens=SMALL_LADDERS["max_num_seqs"])
    report = plan("preset:llama3-8b", target, tensor_parallel_size=tp, num_kv_blocks=1024,
                  hf_overrides=depth, kv_cache_dtype=kv_dtype, **options)
    _assert_compiled_and_fits(report)
    assert report.kv_layout == "fused"


@pytest.mark.parametrize("target,fixture", [  # ~40 s each on 2 cores: one by default
    ("h100", "ct_fp8_dynamic"),
    pytest.param("v5e:1x1", "ct_w8a8_int8", marks=pytest.mark.slow),
    pytest.param("v5e:1x1", "ct_fp8_dynamic", marks=pytest.mark.slow),
    pytest.param("h100", "ct_w8a8_int8", marks=pytest.mark.slow),
    pytest.param("h100", "gptq_actorder", marks=pytest.mark.slow),
    pytest.param("v5e:1x1", "gptq_actorder", marks=pytest.mark.slow),
    pytest.param("h100", "ct_fp8_block", marks=pytest.mark.slow),
    pytest.param("v5e:1x1", "ct_fp8_block", marks=pytest.mark.slow)])
def test_prequantized_checkpoint_programs_compile(target, fixture):
    """A pre-quantized checkpoint's programs (``tests/data/quantized``: FP8 W8A8, int8 W8A8,
    GPTQ act-order, FP8 blocks with activations rounded per group) compile for an H100 and
    a v5e, every one fitting and none holding a copy of the KV cache; where the GPU
    multiplies 8-bit codes they are kept ``[out, in]``."""
    import os

    from jaxpage.models.prequantized import for_device
    from jaxpage.models.weight_sources import open_source
    from jaxpage.parallel.targets import target_devices

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "quantized",
                        fixture)
    # 8 blocks, what these sequences can use: XLA:TPU moves a cache that small (147 KiB)
    # into VMEM and back within a step, which read as temporaries growing with the cache
    # (8-bit group-scaled weights: ct_fp8_block) until the planner measured such a slope
    # again at GROWTH_PROBE_BYTES
    report = plan(path, target, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
                  num_scheduler_steps=4, swap_space=0.0005, num_kv_blocks=8)
    _assert_compiled_and_fits(report)
    source = open_source(path)
    from jaxpage.models.registry import resolve_architecture

    arch = resolve_architecture(source.hf_config)[1]
    formats = for_device(source.stored.plan(arch, source.names()), target_devices(target)[0])
    assert formats["q_proj"].transposed == (target == "h100" and fixture in ("ct_fp8_dynamic",
                                                                          "ct_w8a8_int8"))


@pytest.mark.slow  # ~15 s; the same formats as the ct_fp8_dynamic case above
def test_fp8_quantized_as_it_loads_compiles_for_an_h100_with_codes_out_by_in():
    """``quantization="fp8"`` on a float checkpoint, planned for an H100 (whose plan keeps
    the codes ``[out, in]``: tests/models/test_fp8_online.py): every program compiles and
    fits, none holding a copy of the KV cache."""
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "quantized",
                        "float_source")
    report = plan(path, "h100", quantization="fp8", max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=64, num_scheduler_steps=4, swap_space=0.0005)
    _assert_compiled_and_fits(report)
