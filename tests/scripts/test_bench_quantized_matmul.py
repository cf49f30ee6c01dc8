"""``scripts/bench_quantized_matmul.py`` runs every format side by side (tiny shapes, CPU)."""

import json

import bench_quantized_matmul


def test_every_format_is_timed_against_bf16(tmp_path, capsys):
    out = tmp_path / "q.json"
    assert bench_quantized_matmul.main(["--scale", "64", "--tokens", "1,8", "--iters", "1",
                                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["format"]) for r in rows] == [
        (t, f) for t in (1, 8) for f in bench_quantized_matmul.FORMATS]
    assert all(r["seconds"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "| 8 | fp8_w8a8 |" in printed and "x |" in printed
