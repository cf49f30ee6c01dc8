"""Hugging Face Hub model ids, resolved offline from a local Hub cache built here (no
network in tests): ``LLM("org/name")``, ``revision``, ``download_dir``, ``HF_HUB_OFFLINE``,
and a clear error naming an id that cannot be resolved."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from jaxpage.models.hub import is_hub_id, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, repo: str, files: Path, refs=("main",), commit=COMMIT) -> Path:
    """The layout huggingface_hub keeps: refs/<name> holds a commit, snapshots/<commit>/
    the files."""
    folder = root / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    shutil.copytree(files, snapshot)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_ids_and_paths_are_told_apart(tmp_path):
    assert is_hub_id("meta-llama/Llama-3.1-8B-Instruct") and is_hub_id("gpt2")
    assert not is_hub_id(str(tmp_path))  # an existing directory is a path
    assert not is_hub_id("a/b/c") and not is_hub_id("bad id!")
    assert resolve_model(None) is None and resolve_model("preset:tiny-llama") == "preset:tiny-llama"
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_a_hub_id_resolves_from_the_cache_offline(tiny_checkpoints, tmp_path, offline):
    snapshot = _hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", Path(tiny_checkpoints["llama"]),
                          refs=("main", "v1"))
    got = resolve_model("tiny-org/tiny-llama", download_dir=str(tmp_path / "hub"))
    assert Path(got) == snapshot
    assert Path(resolve_model("tiny-org/tiny-llama", revision="v1",
                              download_dir=str(tmp_path / "hub"))) == snapshot
    with pytest.raises(ValueError, match="tiny-org/tiny-llama.*revision 'v2'"):
        resolve_model("tiny-org/tiny-llama", revision="v2", download_dir=str(tmp_path / "hub"))


def test_an_unknown_id_is_a_clear_error(tmp_path, offline):
    with pytest.raises(ValueError, match=r"model='nobody/nothing'.*HF_HUB_OFFLINE"):
        resolve_model("nobody/nothing", download_dir=str(tmp_path))
    with pytest.raises(ValueError, match="neither a local path nor a Hugging Face Hub"):
        resolve_model("bad id!")
    with pytest.raises(ValueError, match="'not/a/path' does not exist"):  # a path, not an id
        resolve_model("not/a/path")


def test_llm_serves_a_hub_id_with_the_same_tokens_as_its_path(tiny_checkpoints, tmp_path,
                                                              offline, monkeypatch):
    from jaxpage import LLM, SamplingParams

    _hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", Path(tiny_checkpoints["llama"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    options = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                   num_kv_blocks=16, block_size=8, bucket_growth=4096)
    params = SamplingParams(temperature=0, max_tokens=6)
    by_id = LLM("tiny-org/tiny-llama", download_dir=str(tmp_path / "hub"), **options)
    by_path = LLM(tiny_checkpoints["llama"], **options)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    assert (by_id.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            == by_path.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert os.path.realpath(by_id.llm_engine.config.model.model).startswith(
        os.path.realpath(tmp_path / "hub"))
