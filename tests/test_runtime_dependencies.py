"""Every third-party package the project imports at run time is a declared dependency.

``make run`` installs ``jaxpage`` with its runtime dependencies alone (no test extras), so
a module that ``jaxpage/`` or ``pallas_kernels/`` imports but that reaches the environment
only through a test extra, or as some other package's dependency, breaks the README's
first command on a fresh machine the day that other package stops bringing it.

Every import statement is read from the source (function-level imports included, as in
``test_layering.py``); each third-party top-level module is resolved to the distribution
that installs it (``importlib.metadata.packages_distributions``) and must be one named in
``[project].dependencies`` of ``pyproject.toml``, or be listed in ``OPTIONAL_IMPORTS`` with
the extra that installs it, in which case it may only be imported inside a function (where
the feature runs), never at a module's top level.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from tests.test_layering import ROOT, project_modules, read_imports

# Top-level module -> the extra of pyproject.toml that installs it, for features that are
# optional at run time. Such a module is imported lazily where its feature runs, with an
# error naming the extra (none today: every run-time import is a declared dependency).
OPTIONAL_IMPORTS: dict[str, str] = {}


def _normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def declared_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> tuple[set[str], dict[str, set[str]]]:
    """(runtime distribution names, extra -> its distribution names), normalized."""
    project = tomllib.loads(pyproject.read_text())["project"]
    runtime = {_requirement_name(r) for r in project.get("dependencies", [])}
    extras = {extra: {_requirement_name(r) for r in requirements}
              for extra, requirements in project.get("optional-dependencies", {}).items()}
    return runtime, extras


def third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the project modules that import it."""
    _, external = read_imports(project_modules())
    importers: dict[str, set[str]] = {}
    for module, names in external.items():
        for name in names:
            if name and name != "__future__" and name not in sys.stdlib_module_names:
                importers.setdefault(name, set()).add(module)
    return importers


def top_level_imports(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports outside any function (at import
    time of the module itself: its body, and ``if`` / ``try`` blocks at that level)."""
    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                names.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.partition(".")[0])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            else:  # if / try / with / class bodies run at import time too
                for field in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, field, None)
                    if isinstance(children, list):
                        visit([c for c in children if isinstance(c, ast.stmt)]
                              + [s for h in children if isinstance(h, ast.ExceptHandler)
                                 for s in h.body])

    visit(ast.parse(path.read_text(), str(path)).body)
    return names


def test_every_third_party_import_is_a_declared_runtime_dependency():
    runtime, extras = declared_dependencies()
    providers = importlib.metadata.packages_distributions()
    problems = []
    for name, importers in sorted(third_party_imports().items()):
        where = ", ".join(sorted(importers)[:3]) + (" ..." if len(importers) > 3 else "")
        distributions = {_normalize(d) for d in providers.get(name, [])}
        if not distributions:
            problems.append(f"{name!r} (imported by {where}) is installed by no distribution here, "
                            "so it cannot be checked: install the project's test extras")
            continue
        if distributions & runtime:
            continue
        extra = OPTIONAL_IMPORTS.get(name)
        if extra is not None and distributions & extras.get(extra, set()):
            continue
        problems.append(f"{name!r} (imported by {where}) comes from {sorted(distributions)}, "
                        "which is not in [project].dependencies of pyproject.toml"
                        + (f" nor in the extra {extra!r}" if extra else ""))
    assert not problems, "undeclared run-time imports:\n  " + "\n  ".join(problems)


def test_optional_imports_are_lazy_and_their_extras_exist():
    _, extras = declared_dependencies()
    for name, extra in OPTIONAL_IMPORTS.items():
        assert extra in extras, f"OPTIONAL_IMPORTS[{name!r}] names the missing extra {extra!r}"
    eager = [f"{module} imports {name} at its top level"
             for module, path in project_modules().items()
             for name in top_level_imports(path) if name in OPTIONAL_IMPORTS]
    assert not eager, "optional packages must be imported where their feature runs:\n  " + \
        "\n  ".join(eager)


def test_the_checks_see_real_imports(tmp_path):
    """The readers above are not vacuous: they find the project's own declared imports,
    and a top-level import in a module is told apart from one inside a function."""
    runtime, extras = declared_dependencies()
    assert {"jax", "numpy", "fastapi"} <= runtime and "torch" in extras["test"]
    assert {"jax", "numpy", "fastapi", "uvicorn"} <= set(third_party_imports())
    source = tmp_path / "m.py"
    source.write_text("import a.b\ntry:\n    from c import d\nexcept ImportError:\n    import e\n"
                      "def f():\n    import g\nclass K:\n    import h\n")
    assert top_level_imports(source) == {"a", "c", "e", "h"}
