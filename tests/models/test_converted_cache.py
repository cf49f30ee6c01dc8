"""Converted GGUF weights are cached (``jaxpage/models/converted_cache.py``).

A second load reads the converted params back instead of parsing and dequantizing the
file again, and gets exactly the same arrays; a stale or corrupted entry is converted
again, never trusted. Counted, not timed: ``GGUFSource.get`` (one dequantized tensor) and
``GGUFReader`` (one parse of the file).
"""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from jaxpage.models import gguf_source
from jaxpage.models.loader import load_model

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 96


def write_tiny_gguf(path: Path, seed: int) -> Path:
    """A 2-layer Llama GGUF file: Q8_0 linears, float32 norms, tied embeddings."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)

    def add(name: str, *shape: int) -> None:  # shape as Hugging Face stores it: [out, in]
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 1:
            writer.add_tensor(name, values + 1)
        else:
            writer.add_tensor(name, quantize(values, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)

    kv_dim = KV_HEADS * HIDDEN // HEADS
    add("token_embd.weight", VOCAB, HIDDEN)
    add("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", HIDDEN)
        add(f"blk.{i}.ffn_norm.weight", HIDDEN)
        add(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.attn_k.weight", kv_dim, HIDDEN)
        add(f"blk.{i}.attn_v.weight", kv_dim, HIDDEN)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", INTER, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, INTER)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(autouse=True)
def float_weights(monkeypatch):
    """The converted cache holds floats: these tests load the file's weights as floats
    (by default float32 on the CPU keeps Q8_0 / Q4_x blocks as stored, read each start)."""
    monkeypatch.setenv("JAXPAGE_GGUF_BLOCKS", "0")


@pytest.fixture
def counts(monkeypatch) -> dict[str, int]:
    """How many tensors were dequantized and how many times a GGUF file was parsed."""
    counted = {"dequantized": 0, "parsed": 0}
    get, reader = gguf_source.GGUFSource.get, gguf_source.GGUFReader

    def counting_get(self, name):
        counted["dequantized"] += 1
        return get(self, name)

    def counting_reader(*args, **kwargs):
        counted["parsed"] += 1
        return reader(*args, **kwargs)

    monkeypatch.setattr(gguf_source.GGUFSource, "get", counting_get)
    monkeypatch.setattr(gguf_source, "GGUFReader", counting_reader)
    return counted


def params(loaded) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(loaded.model, nnx.Param))]


def assert_same_params(a, b) -> None:
    for x, y in zip(params(a), params(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def only_entry(cache: Path, dtype: str = "float32") -> Path:
    (source,) = cache.iterdir()
    (entry,) = [p for p in source.iterdir() if p.name.startswith(dtype)]
    return entry


def test_second_load_reads_the_cache_not_the_file(tmp_path, counts):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    cache = tmp_path / "weights"
    first = load_model(str(gguf), cache_dir=str(cache))
    assert not first.from_cache and counts["dequantized"] > 0 and counts["parsed"] == 1
    counts.update(dequantized=0, parsed=0)

    second = load_model(str(gguf), cache_dir=str(cache))
    assert second.from_cache and counts == {"dequantized": 0, "parsed": 0}
    assert_same_params(second, first)
    assert second.hf_config == first.hf_config and second.arch == first.arch
    assert_same_params(second, load_model(str(gguf)))  # no cache: converted as ever

    # another dtype is another entry, equal to that dtype converted without the cache
    bf16 = load_model(str(gguf), dtype="bfloat16", cache_dir=str(cache))
    assert not bf16.from_cache
    again = load_model(str(gguf), dtype="bfloat16", cache_dir=str(cache))
    assert again.from_cache
    assert_same_params(again, load_model(str(gguf), dtype="bfloat16"))


def test_kept_blocks_have_an_entry_of_their_parts(tmp_path, counts, monkeypatch):
    """float32 on the CPU keeps the file's Q8_0 blocks: a second start memory-maps the
    saved parts (codes int8, scales float32) instead of parsing and repacking the file."""
    monkeypatch.setenv("JAXPAGE_GGUF_BLOCKS", "1")
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    cache = tmp_path / "weights"
    first = load_model(str(gguf), cache_dir=str(cache))
    assert first.quant_plan and first.quantization is None
    assert not first.from_cache and counts["parsed"] == 1
    counts.update(dequantized=0, parsed=0)

    second = load_model(str(gguf), cache_dir=str(cache))
    assert second.from_cache and counts == {"dequantized": 0, "parsed": 0}
    assert second.quant_plan == first.quant_plan
    assert_same_params(second, first)
    assert_same_params(second, load_model(str(gguf)))  # no cache: kept as ever
    layer = nnx.state(second.model, nnx.Param)["layers"][0]["q_proj"]
    assert layer["codes"][...].dtype == np.int8 and layer["scale"][...].dtype == np.float32
    monkeypatch.setenv("JAXPAGE_GGUF_BLOCKS", "0")  # floats: the other entry
    floats = load_model(str(gguf), cache_dir=str(cache))
    assert not floats.quant_plan and not floats.from_cache


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "garble the manifest",
                                    "another dtype's manifest"])
def test_corrupted_entry_is_converted_again(tmp_path, counts, damage):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    cache = tmp_path / "weights"
    first = load_model(str(gguf), cache_dir=str(cache))
    entry = only_entry(cache)
    data, manifest = entry / "params.bin", entry / "manifest.json"
    if damage == "flip a byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:-64])
    elif damage == "garble the manifest":
        manifest.write_text(manifest.read_text()[:-10])
    else:
        saved = json.loads(manifest.read_text())
        saved["identity"]["dtype"] = "bfloat16"
        manifest.write_text(json.dumps(saved))
    counts.update(dequantized=0, parsed=0)

    rebuilt = load_model(str(gguf), cache_dir=str(cache))
    assert not rebuilt.from_cache and counts["dequantized"] > 0
    assert_same_params(rebuilt, first)
    assert load_model(str(gguf), cache_dir=str(cache)).from_cache  # the entry was replaced


def test_changed_file_makes_the_entry_stale(tmp_path, counts):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    cache = tmp_path / "weights"
    old = load_model(str(gguf), cache_dir=str(cache))
    write_tiny_gguf(gguf, seed=1)  # same path and size, other weights
    stat = os.stat(gguf)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    counts.update(dequantized=0, parsed=0)

    new = load_model(str(gguf), cache_dir=str(cache))
    assert not new.from_cache and counts["parsed"] >= 1 and counts["dequantized"] > 0
    assert_same_params(new, load_model(str(gguf)))
    assert not np.array_equal(params(new)[0], params(old)[0])


def test_second_engine_loads_converted_weights_from_cache(tmp_path, monkeypatch, counts,
                                                          smollm2_tokenizer):
    from jaxpage import LLM

    monkeypatch.setenv("JAXPAGE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    tokenizer = tmp_path / "tokenizer"
    smollm2_tokenizer.save_pretrained(str(tokenizer))
    options = dict(tokenizer=str(tokenizer), max_model_len=64, max_num_seqs=2,
                   max_num_batched_tokens=16, block_size=8, num_kv_blocks=8,
                   compilation_cache=False)
    LLM(str(gguf), **options)
    assert counts["dequantized"] > 0 and counts["parsed"] == 1
    assert any((tmp_path / "cache" / "weights").rglob("params.bin"))
    counts.update(dequantized=0, parsed=0)

    LLM(str(gguf), **options)
    assert counts == {"dequantized": 0, "parsed": 0}

    LLM(str(gguf), weight_cache=False, **options)  # the option turns the cache off
    assert counts["dequantized"] > 0 and counts["parsed"] == 1


def test_planning_reads_a_gguf_files_config_from_the_cache(tmp_path, monkeypatch, counts):
    """``AbstractEngine`` (``jaxpage plan``, the deviceless compiles) opens a checkpoint
    as a live engine does: the first plan parses the GGUF file once and saves its config,
    later plans (and starts) read it from the cache; ``weight_cache=False`` parses."""
    from jaxpage.config import EngineConfig
    from jaxpage.parallel.targets import target_devices
    from jaxpage.planning.abstract_engine import AbstractEngine

    monkeypatch.setenv("JAXPAGE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)

    def plan(**options):
        config = EngineConfig.from_kwargs(model=str(gguf), max_model_len=64, max_num_seqs=2,
                                          max_num_batched_tokens=16, **options)
        return AbstractEngine(config, target_devices("h100"), num_kv_blocks=8)

    first = plan(quantization="gguf")
    assert counts["parsed"] == 1
    second = plan(quantization="gguf")
    assert counts["parsed"] == 1   # config and tensor types from the cache
    assert second.hf_config == first.hf_config and second.arch == first.arch
    plan(weight_cache=False)
    assert counts["parsed"] == 2
