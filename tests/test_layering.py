"""The floors of the code stay put: no import from a lower floor into a higher one, no circles.

Every import statement of every module in ``jaxpage/`` and ``pallas_kernels/`` is read
from its source (function-level imports included, so a lazy import cannot hide a
violation). The floors, lowest first, are written down in ``docs/architecture.md``; a
module may import its own floor and the floors below. A module that belongs to no floor
fails the test, so a new package has to be placed deliberately.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxpage", "pallas_kernels")

# Lowest first. A module belongs to the floor of its longest matching prefix.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("kernels", ("pallas_kernels",)),
    ("config", ("jaxpage.config", "jaxpage.checks", "jaxpage.speculative_config",
                "jaxpage.arch_config", "jaxpage.sampling_params", "jaxpage.beam_search",
                "jaxpage.outputs", "jaxpage.lora_request")),
    ("core", ("jaxpage.core",)),
    ("parallel", ("jaxpage.parallel",)),
    ("models", ("jaxpage.models",)),
    ("runtime", ("jaxpage.runtime",)),
    ("planning", ("jaxpage.planning",)),
    ("engine", ("jaxpage.engine",)),
    ("server", ("jaxpage.server",)),
    ("cli", ("jaxpage.cli", "jaxpage.cli_flags")),
    ("api", ("jaxpage",)),  # the package's lazy facade (``jaxpage/__init__.py``) only
]
NO_JAX_FLOORS = ("config", "core")  # the host-side scheduler never needs JAX
ACCELERATOR_PACKAGES = ("jax", "jaxlib", "flax")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, attribute: str | None, modules: dict[str, Path]) -> str | None:
    """The project module an import refers to (``from a.b import c`` -> ``a.b.c`` when
    that is a module, else ``a.b``); None for third-party modules."""
    if attribute is not None and f"{name}.{attribute}" in modules:
        return f"{name}.{attribute}"
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def read_imports(modules: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project imports, top-level third-party packages) of every module."""
    edges: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        outside: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against the importing package
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                pairs = [(base, alias.name) for alias in node.names]
            else:
                continue
            for name, attribute in pairs:
                target = _resolve(name, attribute, modules)
                if target is None:
                    outside.add(name.partition(".")[0])
                elif target != module:
                    targets.add(target)
        edges[module] = targets
        external[module] = outside
    return edges, external


def floor_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if prefix == "jaxpage":  # the facade is the package itself, not a prefix
                matches = module == "jaxpage"
            else:
                matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise LookupError(module)
    return best


def layering_violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports that go up a floor, as readable lines."""
    found = []
    for module, targets in sorted(edges.items()):
        for target in sorted(targets):
            if floor_of(target) > floor_of(module):
                found.append(f"{module} ({FLOORS[floor_of(module)][0]}) imports {target} "
                             f"({FLOORS[floor_of(target)][0]})")
    return found


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


@pytest.fixture(scope="module")
def graph():
    modules = project_modules()
    assert len(modules) > 50, modules  # the walk found the code  # the walk found the code
    return read_imports(modules)


def test_every_module_has_a_floor(graph):
    edges, _ = graph
    homeless = []
    for module in edges:
        try:
            floor_of(module)
        except LookupError:
            homeless.append(module)
    assert not homeless, f"place these in FLOORS and docs/architecture.md: {homeless}"


def test_no_import_goes_up_a_floor(graph):
    edges, _ = graph
    assert layering_violations(edges) == []


def test_no_import_circles(graph):
    edges, _ = graph
    assert import_cycles(edges) == []


def test_host_floors_never_import_jax(graph):
    """Neither the configuration modules nor ``core`` reach JAX, even through the project."""
    edges, external = graph
    no_jax = [m for m in edges if FLOORS[floor_of(m)][0] in NO_JAX_FLOORS]
    offenders = []
    for module in no_jax:
        seen, todo = set(), [module]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            todo.extend(edges[current])
            for package in external[current] & set(ACCELERATOR_PACKAGES):
                offenders.append(f"{module} reaches {package} through {current}")
    assert not offenders, offenders


def test_the_floors_are_documented():
    text = (ROOT / "docs" / "architecture.md").read_text()
    positions = [text.find(f"`{name}`") for name, _ in FLOORS]
    assert all(p >= 0 for p in positions), [n for (n, _), p in zip(FLOORS, positions) if p < 0]


# -- the checker itself catches what it should ------------------------------------------

def test_checker_finds_an_upward_import_and_a_circle(tmp_path):
    files = {
        "jaxpage/__init__.py": "",
        "jaxpage/core/__init__.py": "",
        "jaxpage/core/a.py": "def f():\n    from jaxpage.engine import b\n",
        "jaxpage/engine/__init__.py": "",
        "jaxpage/engine/b.py": "from . import c\nimport numpy\n",
        "jaxpage/engine/c.py": "from jaxpage.engine.b import thing\nimport jax.numpy\n",
        "pallas_kernels/__init__.py": "",
        "pallas_kernels/k.py": "import jaxpage.core.a as a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges, external = read_imports(project_modules(tmp_path))
    assert edges["jaxpage.core.a"] == {"jaxpage.engine.b"}
    assert edges["jaxpage.engine.b"] == {"jaxpage.engine.c"}
    assert external["jaxpage.engine.c"] == {"jax"}
    assert layering_violations(edges) == [
        "jaxpage.core.a (core) imports jaxpage.engine.b (engine)",
        "pallas_kernels.k (kernels) imports jaxpage.core.a (core)"]
    assert import_cycles(edges) == [["jaxpage.engine.b", "jaxpage.engine.c"]]


def test_core_reaches_no_device_through_an_injected_object(tiny_checkpoints):
    """``core`` never calls the device through an object handed to it: a draft model's
    proposals (a device call) are asked for by the engine between scheduling and building
    the batch, never from inside ``Scheduler.schedule``. The proposer here fails if any
    frame of ``schedule`` is on the stack when it is called; it must still be called."""
    import inspect

    from jaxpage import LLM, SamplingParams
    from tests.options import TINY

    path = tiny_checkpoints["llama"]
    llm = LLM(path, speculative_config={"method": "draft_model", "model": path,
                                        "num_speculative_tokens": 2,
                                        "disable_by_batch_size": 8}, **TINY)
    proposer = llm.llm_engine.draft_proposer
    propose_batch, calls = proposer.propose_batch, []
    core = str(ROOT / "jaxpage" / "core")

    def guarded(rows):
        callers = [info.filename for info in inspect.stack()[1:]]
        assert not any(name.startswith(core) for name in callers), \
            f"a draft proposal was asked for from core: {callers}"
        calls.append(len(rows))
        return propose_batch(rows)

    proposer.propose_batch = guarded
    outputs = llm.generate(["one two three", "four five"],
                           SamplingParams(temperature=0, max_tokens=6))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert calls and llm.get_stats()["spec_num_drafts"] > 0
    scheduler = llm.llm_engine.scheduler
    assert not any(isinstance(value, type(proposer)) for part in (
        scheduler, scheduler.speculation, scheduler.applier, scheduler.ahead)
        for value in vars(part).values())
