"""tune_gpu_attention.py end to end in interpret mode (CPU): every part the lent GPU's
first call runs (the ceilings, bf16 decode, prefill, a byte format with its variant
columns, the tables and the tuning file) runs through once, so a crash is found here,
not in minutes of device time. Timings are meaningless here; the outputs are compared
with the reference as on the device."""

from __future__ import annotations

import json

import tune_gpu_attention
from pallas_kernels.ragged_paged_attention.gpu_config import FIELDS


def test_the_tuner_runs_every_part_in_interpret_mode(tmp_path, capsys):
    out, table = tmp_path / "tune.json", tmp_path / "gpu_tuned.json"
    assert tune_gpu_attention.main([
        "--interpret", "--quick", "--decode-shapes", "2x64", "--prefill-shapes", "1x32",
        "--kv-formats", "bfloat16,int8", "--budget-s", "1", "--calls", "1", "--repeats", "1",
        "--json", str(out), "--tuning-out", str(table)]) == 0
    printed = capsys.readouterr().out
    assert "decode bfloat16: chosen" in printed and "decode int8: chosen" in printed
    assert "prefill: chosen" in printed
    result = json.loads(out.read_text())
    for part in result["decode"]:   # every searched configuration ran and matched the reference
        timed = [r for r in part["searched"] if "ms" in r]
        assert timed and all(r["rel_err"] < 2e-2 for r in timed), part["searched"]
    entries = json.loads(table.read_text())["entries"]
    assert {(e["phase"], e["kv_bytes"], e.get("kv_format")) for e in entries} == {
        ("decode", 2, None), ("prefill", 2, None), ("decode", 1, None), ("decode", 1, "int8")}
    assert all(set(e["config"]) <= set(FIELDS) for e in entries)
    # byte formats are searched in float16 (which entry wins is interpret mode's noise)
    int8 = next(p for p in result["decode"] if p["kv_format"] == "int8")
    assert all(r["config"]["half_products"] for r in int8["searched"]), int8["searched"]
