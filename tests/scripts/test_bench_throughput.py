"""bench_throughput.py end to end on a tiny checkpoint: jaxpage and Hugging Face side by side."""

import json

import pytest

import bench_hf
import bench_throughput
from bench_common import make_workload


@pytest.mark.slow
def test_jaxpage_and_hf_side_by_side_on_a_tiny_checkpoint(tiny_checkpoints, tmp_path):
    out = tmp_path / "out"
    payload = bench_throughput.main([
        "--model", tiny_checkpoints["llama"], "--workload", "sharegpt-like",
        "--num-requests", "6", "--output-len", "5", "--max-model-len", "256",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--num-kv-blocks", "80",
        "--hf-max-batch-size", "4", "--steps", "1,4", "--profile", "--out-dir", str(out),
        "--name", "t", "--no-progress"])
    rows = payload["results"]
    assert [r["system"] for r in rows][:2] == ["jaxpage (K=1)", "jaxpage (K=4)"]
    hf = rows[2]
    assert hf["system"].startswith("hf generate (static batch ")
    assert hf["batch_size"] in (1, 2, 4)
    assert [p["batch_size"] for p in hf["batch_size_probes"]] == [1, 2, 4]
    workload = payload["workload"]
    assert workload["num_requests"] == 6 and workload["output_tokens"] == 30
    for row in rows:
        assert row["output_tokens_per_s"] == pytest.approx(30 / row["wall_s"])
        assert row["total_tokens_per_s"] == pytest.approx(
            (30 + workload["input_tokens"]) / row["wall_s"])
        assert row["requests_per_s"] == pytest.approx(6 / row["wall_s"])
        assert row["ratio_vs_hf"] == pytest.approx(
            row["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert rows[1]["ratio_vs_first"] == pytest.approx(
        rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"])
    assert rows[0]["engine_calls"] > 0 and 0 <= rows[0]["device_idle_fraction"] <= 1
    # HF pads each batch to its longest prompt: it computed at least the wanted tokens.
    assert hf["generated_tokens_incl_padding"] >= 30
    assert json.loads((out / "t.json").read_text())["results"][2]["system"] == hf["system"]
    md = (out / "t.md").read_text()
    assert "output tok/s vs HF" in md and "jaxpage (K=4)" in md and "t.png" in md
    assert "host ms/call" in md
    assert (out / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_legacy_multi_step_mode_on_a_preset(tmp_path):
    payload = bench_throughput.main([
        "--model", "preset:tiny-llama", "--systems", "jaxpage", "--workload", "random",
        "--num-requests", "4", "--input-len", "8", "--output-len", "9", "--steps", "1,8sync,8",
        "--profile", "--isolate", "no", "--out-dir", str(tmp_path), "--no-progress"])
    rows = payload["results"]
    assert [r["config"] for r in rows] == ["1", "8sync", "8"]
    assert [r["num_scheduler_steps"] for r in rows] == [1, 8, 8]
    assert all("ratio_vs_hf" not in r for r in rows)
    assert rows[1]["engine_calls"] < rows[0]["engine_calls"]  # 8 decode steps per call
    assert rows[1]["chained_calls"] == 0                      # sync: nothing dispatched ahead
    assert (tmp_path / "throughput-random.png").exists()


def test_hf_generates_exactly_the_asked_tokens_on_a_preset():
    hf = bench_hf.load_hf_model("preset:tiny-llama", "float32", "cpu")
    assert hf.config.num_hidden_layers == 2 and hf.config.vocab_size == 4096
    assert bench_hf.generate_batch(hf, [[5, 6, 7], [8]], 4) == 4


def test_predicted_schedule_time_counts_each_batch_to_its_longest():
    w = make_workload("random", 100, num_requests=3, input_len=2, output_len=3)
    # batches of 2: [r0, r1], [r2]: two prefills of 2x2 and 1x2 tokens, 3 + 3 decode steps
    assert bench_hf.predict_seconds(w.requests, 2, step_s=1.0, prefill_s_per_token=0.5) == \
        pytest.approx(0.5 * (4 + 2) + 6)
    # steps at contexts 2, 3, 4 in each batch cost 0.1 more per context token
    assert bench_hf.predict_seconds(w.requests, 2, step_s=1.0, prefill_s_per_token=0.5,
                                    step_s_per_context_token=0.1) == \
        pytest.approx(0.5 * (4 + 2) + 6 + 0.1 * 2 * (2 + 3 + 4))


def test_bad_flags_are_clear_errors():
    with pytest.raises(SystemExit):
        bench_throughput.parse_args(["--systems", "jaxpage,vllm"])
    with pytest.raises(SystemExit):
        bench_throughput.parse_args(["--hf-batch-size", "big"])
    with pytest.raises(ValueError, match="dtype='int8'"):
        bench_hf.load_hf_model("preset:tiny-llama", "int8", "cpu")


@pytest.mark.slow
def test_isolated_child_processes_and_the_roofline_column(tmp_path):
    """The accelerator path: each system in its own process, results merged, roofline added."""
    payload = bench_throughput.main([
        "--model", "tiny-llama", "--workload", "random", "--num-requests", "3",
        "--input-len", "6", "--output-len", "4", "--isolate", "yes", "--hf-batch-size", "2",
        "--peak-bandwidth-gbs", "20", "--out-dir", str(tmp_path), "--name", "iso",
        "--no-progress"])
    assert payload["isolated"] is True
    jax_row, hf_row = payload["results"]
    assert jax_row["system"] == "jaxpage (K=8)" and hf_row["batch_size"] == 2
    assert jax_row["output_tokens_per_s"] == pytest.approx(12 / jax_row["wall_s"])
    assert jax_row["ratio_vs_hf"] == pytest.approx(
        jax_row["output_tokens_per_s"] / hf_row["output_tokens_per_s"])
    assert jax_row["peak_bandwidth_gbs"] == 20
    assert jax_row["roofline_fraction"] == pytest.approx(
        jax_row["output_tokens_per_s"] / jax_row["roofline_output_tokens_per_s"])
    assert "fraction of roofline" in (tmp_path / "iso.md").read_text()
