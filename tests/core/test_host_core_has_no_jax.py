"""Seam 1 of DESIGN.md: the host core (scheduler, block manager, batch) never imports jax."""

import pathlib
import re
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parents[2] / "jaxpage" / "core"


def test_no_jax_import_statement_under_core():
    offenders = [str(p) for p in CORE.rglob("*.py")
                 if re.search(r"^\s*(import jax|from jax)\b", p.read_text(), re.M)]
    assert offenders == []


def test_importing_every_core_module_loads_no_jax():
    modules = sorted("jaxpage.core." + ".".join(p.relative_to(CORE).with_suffix("").parts)
                     for p in CORE.rglob("*.py") if p.stem != "__init__")
    assert "jaxpage.core.sched.scheduler" in modules
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib', 'flax')))\n"
            + "print(bad)\nsys.exit(1 if bad else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
