"""bench_backends.py on this machine: the CPU is found, each attention path gets a row."""

import json

import pytest

import bench_backends


@pytest.mark.slow
def test_cpu_rows_for_each_attention_path(tmp_path):
    payload = bench_backends.main([
        "--platforms", "cpu,tpu", "--attention", "kernel,reference",
        "--out-dir", str(tmp_path), "--no-progress",
        "--model", "preset:tiny-llama", "--workload", "random", "--num-requests", "3",
        "--input-len", "8", "--output-len", "4"])
    rows = payload["results"]
    assert [(r["platform"], r["attention"]) for r in rows] == [("cpu", "kernel"),
                                                               ("cpu", "reference")]
    for row in rows:  # the C++ CPU kernel, then the plain-jnp reference
        assert row["status"] == "ok" and row["output_tokens_per_s"] > 0
        assert row["output_tokens_per_s"] * row["wall_s"] == pytest.approx(12)
    assert payload["throughput_args"][:2] == ["--model", "preset:tiny-llama"]
    assert json.loads((tmp_path / "backends.json").read_text())["results"] == rows
    assert "| cpu |" in (tmp_path / "backends.md").read_text()
    assert (tmp_path / "backends.png").exists()
