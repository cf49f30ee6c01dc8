"""Weight-only quantization through ``LLM``: formats, GGUF blocks kept, memory, errors."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from jaxpage import LLM, SamplingParams
from jaxpage.models.quantize import (QuantFormat, dequantize, gguf_parts, group_size_for,
                                     quantize)
from pallas_kernels.quantized_matmul import unpack_panels
from tests.options import FEW_BUCKETS

ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64,
              **FEW_BUCKETS)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was",
           "Water boils at"]


@pytest.mark.parametrize("fmt", [QuantFormat(8), QuantFormat(8, 16), QuantFormat(4, 16),
                                 QuantFormat(4, 64)])
def test_quantize_round_trip_error_is_half_a_step(fmt):
    w = np.random.default_rng(0).standard_normal((64, 40)).astype(np.float32)
    parts = quantize(w, fmt)
    for part, (shape, dtype) in fmt.shapes(64, 40).items():
        assert parts[part].shape == shape and parts[part].dtype == dtype
    step = np.repeat(parts["scale"], 64 // parts["scale"].shape[0], axis=0)
    assert np.all(np.abs(dequantize(parts) - w) <= step / 2 + 1e-6)


def test_group_size_for_divides_the_input():
    assert group_size_for(4096) == 128 and group_size_for(576) == 64
    assert group_size_for(1536, 256) == 256 and group_size_for(6) == 2
    assert group_size_for(576, 0) is None  # one group: per output channel
    with pytest.raises(ValueError, match="even"):
        group_size_for(9)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_repack_bit_for_bit(qtype):
    out_f, in_f = 24, 96
    w = np.random.default_rng(1).standard_normal((out_f, in_f)).astype(np.float32)
    kind = GGMLQuantizationType[qtype]
    raw = gguf_quantize(w, kind)                                  # uint8 [out, bytes]
    expected = gguf_dequantize(raw, kind).reshape(out_f, in_f)    # HF [out, in]
    parts = gguf_parts(raw, qtype, out_f, in_f)
    np.testing.assert_array_equal(dequantize(parts), expected.T)  # ours is [in, out]


def test_smollm2_file_blocks_repack_bit_for_bit(smollm2_path):
    reader = GGUFReader(smollm2_path)
    tensors = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "blk.3.ffn_down.weight"):
        t = tensors[name]
        out_f, in_f = (int(d) for d in reversed(t.shape))
        expected = gguf_dequantize(t.data, t.tensor_type).reshape(out_f, in_f)
        parts = gguf_parts(np.asarray(t.data), t.tensor_type.name, out_f, in_f)
        np.testing.assert_array_equal(dequantize(parts), expected.T)


def _tokens(llm, prompts, max_tokens=16):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def smollm2_float(smollm2_path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXPAGE_GGUF_BLOCKS", "0")  # the file's weights as float32 arrays
        llm = LLM(smollm2_path, **ENGINE)
    assert not llm.llm_engine.runner.quant_plan
    return _tokens(llm, PROMPTS), llm.get_stats()["weight_bytes"]


def test_by_default_a_gguf_file_keeps_its_blocks_and_the_float_products(
        smollm2_path, smollm2_float):
    """quantization=None on the CPU in float32: the blocks stay as stored (a quarter of the
    bytes), the products are the float32 weights' (same greedy tokens)."""
    tokens, float_bytes = smollm2_float
    llm = LLM(smollm2_path, **ENGINE)
    stats = llm.get_stats()
    assert stats["quantization"] is None
    assert stats["weight_bytes"] <= 0.25 * float_bytes, (stats["weight_bytes"], float_bytes)
    up_proj = llm.llm_engine.runner.params["layers"][0]["up_proj"]
    # packed by panels for the CPU kernels: [1536 / 64, 576 / 2, 64]
    assert up_proj["codes"].dtype == np.uint8 and up_proj["codes"].shape == (24, 288, 64)
    assert _tokens(llm, PROMPTS) == tokens


def test_gguf_blocks_kept_serve_the_same_tokens_from_a_quarter_of_the_memory(
        smollm2_path, smollm2_float):
    tokens, float_bytes = smollm2_float
    llm = LLM(smollm2_path, quantization="gguf", **ENGINE)
    stats = llm.get_stats()
    assert stats["quantization"] == "gguf"
    assert stats["weight_bytes"] <= 0.25 * float_bytes, (stats["weight_bytes"], float_bytes)
    assert _tokens(llm, PROMPTS) == tokens
    params = llm.llm_engine.runner.params
    assert params["embed"]["codes"].dtype == np.int8                   # Q8_0 in the file
    assert params["layers"][0]["down_proj"]["codes"].dtype == np.uint8  # Q4_1 in the file


def test_int8_weights_keep_smollm2_greedy_tokens(smollm2_path, smollm2_float):
    tokens, float_bytes = smollm2_float
    llm = LLM(smollm2_path, quantization="int8", **ENGINE)
    # groups of 32, a zero per group on the projections: 30.6% of float32's bytes
    # (docs/quantization.md: 1.6 points more than groups of 128 bought 96 -> 100% top-1)
    assert llm.get_stats()["weight_bytes"] <= 0.31 * float_bytes
    params = llm.llm_engine.runner.params
    assert "zero" in params["layers"][0]["q_proj"] and "zero" not in params["embed"]
    ours = _tokens(llm, PROMPTS)
    agree = sum(a[:8] == b[:8] for a, b in zip(ours, tokens))
    assert agree == len(PROMPTS), (ours, tokens)
    per_channel = LLM(smollm2_path, quantization="int8", quantization_group_size=0, **ENGINE)
    q_proj = unpack_panels(per_channel.llm_engine.runner.params["layers"][0]["q_proj"])
    assert q_proj["scale"].shape[0] == 1
    assert per_channel.get_stats()["weight_bytes"] < llm.get_stats()["weight_bytes"]


def test_int4_runs_and_bad_options_are_refused(smollm2_path, tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], quantization="int4", quantization_group_size=32,
              **ENGINE)
    assert len(_tokens(llm, PROMPTS[:2], 4)[0]) == 4
    q_proj = unpack_panels(llm.llm_engine.runner.params["layers"][0]["q_proj"])
    assert q_proj["scale"].shape[0] == 64 // 32
    with pytest.raises(ValueError, match="quantization='fp4'"):
        LLM(smollm2_path, quantization="fp4", **ENGINE)
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(tiny_checkpoints["llama"], quantization="gguf", **ENGINE)
    with pytest.raises(ValueError, match="needs a GGUF file"):
        LLM("preset:tiny-llama", quantization="gguf", **ENGINE)
    with pytest.raises(ValueError, match="quantization_group_size=1 "):
        LLM(smollm2_path, quantization="int4", quantization_group_size=1, **ENGINE)


def test_quantized_preset_and_orbax_restart_without_requantizing(tmp_path):
    llm = LLM("preset:tiny-llama", quantization="int8", **ENGINE)
    ids = [[5, 6, 7, 8, 9], [100, 3, 3]]
    prompts = [{"prompt_token_ids": p} for p in ids]
    before = _tokens(llm, prompts, 6)
    path = llm.save_sharded_checkpoint(str(tmp_path / "ckpt"))
    restored = LLM(path, **ENGINE)
    assert restored.get_stats()["quantization"] == "int8"
    assert restored.get_stats()["weight_bytes"] == llm.get_stats()["weight_bytes"]
    assert _tokens(restored, prompts, 6) == before
    with pytest.raises(ValueError, match="saved with quantization='int8'"):
        LLM(path, quantization="int4", **ENGINE)


def test_float_orbax_checkpoint_is_quantized_as_it_loads(tmp_path):
    floats = LLM("preset:tiny-llama", **ENGINE)
    path = floats.save_sharded_checkpoint(str(tmp_path / "float"))
    direct = LLM("preset:tiny-llama", quantization="int8", **ENGINE)
    restored = LLM(path, quantization="int8", **ENGINE)
    assert restored.get_stats()["quantization"] == "int8"
    assert restored.get_stats()["weight_bytes"] == direct.get_stats()["weight_bytes"]
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    assert _tokens(restored, prompts, 6) == _tokens(direct, prompts, 6)
    with pytest.raises(ValueError, match="quantization='gguf'"):
        LLM(path, quantization="gguf", **ENGINE)
