"""The package's own imports form no cycle, and the modules that read finished runs or plan
runs never import the training side: each concept has one owner and arrows point one way."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hsdp_runner"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every hsdp_runner module ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module name -> the package modules it imports (itself excluded)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: _imports(path, known) - {name, "hsdp_runner", "hsdp_runner.models"}
            for name, path in paths.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_package_imports_form_no_cycle():
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_readers_of_finished_runs_never_import_the_training_side():
    graph = import_graph()
    training = {"hsdp_runner.trainer", "hsdp_runner.worker", "hsdp_runner.sharding"}
    # run_figures computes the fixed figures the trainer is handed: it must not need it.
    for reader in ("hsdp_runner.compare", "hsdp_runner.tracking", "hsdp_runner.models.llama",
                   "hsdp_runner.models.gpt2", "hsdp_runner.comm_model", "hsdp_runner.run_figures",
                   "hsdp_runner.contracts", "hsdp_runner.runs"):
        assert not (_reachable(graph, reader) & training), reader


def test_the_runner_reaches_models_only_through_the_seam():
    """Outside ``hsdp_runner/models/`` no module imports a model family (mesh, sharding,
    trainer, checkpoint, planner...): they use ``models.base`` (model_spec, build_meta_model)."""
    graph = import_graph()
    families = {m for m in graph if m.startswith("hsdp_runner.models.")} - {"hsdp_runner.models.base"}
    assert {"hsdp_runner.models.llama", "hsdp_runner.models.gpt2"} <= families
    for module, deps in sorted(graph.items()):
        if not module.startswith("hsdp_runner.models."):
            assert not deps & families, f"{module} imports {sorted(deps & families)}"
