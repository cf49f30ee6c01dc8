"""Config dataclasses: validation, the TOML mirror of the defaults, flat keyword routing."""

import dataclasses
import pathlib

import pytest

from jaxpage.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                            SchedulerConfig, load_toml_options)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_configs_engine_toml_mirrors_the_dataclass_defaults():
    options = load_toml_options(str(ROOT / "configs" / "engine.toml"))
    defaults = {f.name: f.default for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)
                for f in dataclasses.fields(cls)}
    assert options, "configs/engine.toml is empty"
    for name, value in options.items():
        assert defaults[name] == value, name
    assert EngineConfig.from_toml(str(ROOT / "configs" / "engine.toml")) == EngineConfig()


def test_flat_keywords_are_routed_to_their_section():
    config = EngineConfig.from_kwargs(block_size=32, max_num_seqs=4, max_num_batched_tokens=8,
                                      dtype="bfloat16")
    assert config.cache.block_size == 32 and config.scheduler.max_num_seqs == 4
    assert config.model.dtype == "bfloat16"


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_num_seqs=0), "max_num_seqs=0"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens=4"),
    (dict(num_kv_blocks=0), "num_kv_blocks=0"),
    (dict(max_model_len=1), "max_model_len=1"),
    (dict(attention_backend="cuda"), "attention_backend='cuda'"),
    (dict(bogus=1), "unknown engine option"),
    (dict(bucket_growth=1), "bucket_growth=1"),
    (dict(hf_overrides="num_hidden_layers=2"), "hf_overrides='num_hidden_layers=2'"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
    (dict(data_parallel_size=1.5), "data_parallel_size=1.5"),
    (dict(num_processes=2), "needs a coordinator_address"),
    (dict(num_processes=2, process_id=2, coordinator_address="h:1"), "process_id=2"),
    (dict(coordinator_address="nohost"), "coordinator_address='nohost'"),
])
def test_bad_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_unknown_toml_table(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text("[engine]\nseed = 1\n")
    with pytest.raises(ValueError, match="unknown table"):
        load_toml_options(str(path))
