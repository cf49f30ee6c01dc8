"""Workload generation and report writing shared by the benchmark scripts."""

import json

import numpy as np
import pytest

import bench_common
from bench_common import make_workload, markdown_table, write_report


def test_random_workload_is_fixed_length_and_seeded():
    a = make_workload("random", 1000, num_requests=5, input_len=12, output_len=7)
    b = make_workload("random", 1000, num_requests=5, input_len=12, output_len=7)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert all(r.prompt_len == 12 and r.output_len == 7 for r in a.requests)
    assert all(10 <= t < 999 for r in a.requests for t in r.prompt_token_ids)
    assert a.num_input_tokens == 60 and a.num_output_tokens == 35
    c = make_workload("random", 1000, num_requests=5, input_len=12, output_len=7, seed=1)
    assert [r.prompt_token_ids for r in c.requests] != [r.prompt_token_ids for r in a.requests]


def test_random_workload_file_defaults_are_the_paper_shape():
    spec = bench_common.workload_spec("random")
    assert (spec["input_len"], spec["output_len"]) == (1024, 128)


def test_sharegpt_like_lengths_follow_the_documented_distribution():
    spec = bench_common.workload_spec("sharegpt-like")
    w = make_workload("sharegpt-like", 49152, num_requests=20000)
    ins = np.array([r.prompt_len for r in w.requests])
    outs = np.array([r.output_len for r in w.requests])
    assert ins.min() >= spec["min_len"] and ins.max() <= spec["max_input_len"]
    assert outs.min() >= spec["min_len"] and outs.max() <= spec["max_output_len"]
    # Clipping trims the tails a little: realized means sit just under the targets.
    assert 0.9 * spec["input_mean"] < ins.mean() <= spec["input_mean"] * 1.02
    assert 0.9 * spec["output_mean"] < outs.mean() <= spec["output_mean"] * 1.02
    # log-normal: median = mean * exp(-sigma^2 / 2)
    expected_median = spec["output_mean"] * np.exp(-spec["output_sigma"] ** 2 / 2)
    assert abs(np.median(outs) - expected_median) / expected_median < 0.05
    w64 = make_workload("sharegpt-like", 49152)
    assert len(w64.requests) == 64 and w64.summary()["num_requests"] == 64


def test_bad_workload_names_and_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="workload='nope'"):
        make_workload("nope", 1000)
    with pytest.raises(ValueError, match="num_requests=0"):
        make_workload("random", 1000, num_requests=0)


def test_resolve_model_flags():
    assert bench_common.resolve_model("default") is None
    assert bench_common.resolve_model("llama3-8b") == "preset:llama3-8b"
    assert bench_common.resolve_model("preset:qwen2-7b") == "preset:qwen2-7b"
    with pytest.raises(ValueError, match="no-such-model"):
        bench_common.resolve_model("no-such-model")
    assert bench_common.vocab_size_of("preset:llama3-8b") == 128256


def test_write_report_writes_json_markdown_and_png(tmp_path):
    rows = [{"system": "a", "x": 1.5}, {"system": "b", "x": 20.25, "y": None}]
    table = markdown_table(rows, [("system", "system"), ("x", "x"), ("y", "y")])
    assert table.splitlines()[2] == "| a | 1.5 | - |"
    assert table.splitlines()[3] == "| b | 20.2 | - |"
    paths = write_report(tmp_path, "r", title="T", payload={"results": rows}, table=table,
                         plot=lambda ax: ax.plot([1, 2], [3, 4]))
    assert json.loads(paths["json"].read_text())["results"] == rows
    assert table in paths["md"].read_text() and "![T](r.png)" in paths["md"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
