"""The package's own imports form no cycle and point one way, from the entry points down to
core: each subpackage owns one concept and never imports a layer above it."""

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


# Bottom to top. A module may import its own layer and the layers below it, never one above.
LAYERS = (
    "core",
    "models",
    "config",
    "distributed",
    "train",
    "checkpoint",
    "report",
    "planner",
    "runtime",
)
ENTRY_POINTS = {"__main__", "plan", "compare", "export", "parity"}


def import_graph() -> dict[str, set[str]]:
    """Module name -> the package modules it imports (itself and packages' __init__ excluded)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    packages = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    known = set(paths)
    return {
        name: _imports(path, known) - {name} - packages
        for name, path in paths.items()
        if name not in packages
    }


def layer_of(module: str) -> int:
    """The index of ``module``'s layer in LAYERS; entry points sit above every layer."""
    part = module.split(".")[1]
    if part in ENTRY_POINTS:
        return len(LAYERS)
    if part not in LAYERS:
        raise ValueError(f"{module} is in no layer: add its package to LAYERS or ENTRY_POINTS")
    return LAYERS.index(part)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
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


def test_every_module_sits_in_a_layer_and_imports_only_its_own_or_lower_layers():
    graph = import_graph()
    upward = [
        f"{module} imports {dep}"
        for module, deps in sorted(graph.items())
        for dep in sorted(deps)
        if layer_of(dep) > layer_of(module)
    ]
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


def test_readers_of_finished_runs_never_import_the_training_side():
    graph = import_graph()
    training = {
        "hsdp_runner.train.trainer",
        "hsdp_runner.runtime.worker",
        "hsdp_runner.runtime.rank_training",
        "hsdp_runner.distributed.parallelize",
    }
    # train.figures computes the fixed figures the trainer is handed: it must not need it.
    for reader in (
        "hsdp_runner.compare",
        "hsdp_runner.train.sinks",
        "hsdp_runner.models.llama",
        "hsdp_runner.models.llama_hf",
        "hsdp_runner.models.gpt2",
        "hsdp_runner.models.gpt2_hf",
        "hsdp_runner.distributed.comm_model",
        "hsdp_runner.train.figures",
        "hsdp_runner.core.records",
        "hsdp_runner.report.runs",
    ):
        assert not (_reachable(graph, reader) & training), reader


def test_the_runner_reaches_models_only_through_the_seam():
    """Outside ``hsdp_runner/models/`` no module imports a model family (mesh, sharding,
    trainer, checkpoint, planner...): they use ``models.base`` (model_spec, build_meta_model)."""
    graph = import_graph()
    shared = {
        "hsdp_runner.models.base",
        "hsdp_runner.models.common",
        "hsdp_runner.models.norm_rope",
        "hsdp_runner.models.params",
    }
    families = {m for m in graph if m.startswith("hsdp_runner.models.")} - shared
    assert {"hsdp_runner.models.llama", "hsdp_runner.models.gpt2"} <= families
    for module, deps in sorted(graph.items()):
        if not module.startswith("hsdp_runner.models."):
            assert not deps & families, f"{module} imports {sorted(deps & families)}"


def _keeps_its_name(alias: str, own: str) -> bool:
    """An alias may qualify a name (``plan_memory`` for planner.memory, ``compose_config``),
    never replace it: the name stays whole at its start or end."""
    return alias == own or alias.endswith("_" + own) or alias.startswith(own + "_")


def renaming_aliases(path: Path, known: set[str]) -> list[str]:
    """``import`` aliases in ``path`` that give a module of ours, or a name imported from one,
    another name (an older module's, or another constant's): 'line: import ... as ...'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            pairs = [(a.name, a.name.rsplit(".", 1)[-1], a.asname) for a in node.names]
            pairs = [p for p in pairs if p[0] in known]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != PACKAGE.name:
                continue
            pairs = [(f"{node.module}.{a.name}", a.name, a.asname) for a in node.names]
        else:
            continue
        found += [
            f"{node.lineno}: {name} as {alias}"
            for name, own, alias in pairs
            if alias and not _keeps_its_name(alias, own)
        ]
    return found


def test_no_import_alias_renames_a_module_or_constant_of_ours():
    known = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{where}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for where in renaming_aliases(path, known)
    ]
    assert not found, "aliases that rename (import it under its own name):\n" + "\n".join(found)


def test_renaming_aliases_sees_an_older_name(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from hsdp_runner.distributed import parallelize as sharding\n"
        "from hsdp_runner.distributed.world_mesh import STAGE_DIMS as DIM_NAMES\n"
        "import hsdp_runner.models as package\n"
        "from hsdp_runner.planner import memory as plan_memory\n"
        "import torch.distributed as dist\n"
    )
    known = {"hsdp_runner.models"}
    assert renaming_aliases(source, known) == [
        "1: hsdp_runner.distributed.parallelize as sharding",
        "2: hsdp_runner.distributed.world_mesh.STAGE_DIMS as DIM_NAMES",
        "3: hsdp_runner.models as package",
    ]


# What runs a job: the training loop and the runtime's job side. The planner predicts without
# running one: it may use the pieces a job is made of (the model, the sharding applier, the
# loss, the figures' tables) but not the loop, a launcher or a worker. The forkserver (and the
# reaper it stops the server with) runs no job: the planner's measuring children are forked
# from it, a server a caller above the planner hands it (``planner.memory.start_children_in``:
# ``plan.py``, or a ``parallel=auto`` job's launcher).
NOT_A_JOB = {"hsdp_runner.runtime.forkserver", "hsdp_runner.runtime.reaper"}


def test_the_planner_reaches_nothing_that_runs_a_job():
    graph = import_graph()
    runs_a_job = {"hsdp_runner.train.trainer"} | {
        m for m in graph if m.startswith("hsdp_runner.runtime.") and m not in NOT_A_JOB
    }
    planners = [m for m in graph if m.startswith("hsdp_runner.planner.")] + ["hsdp_runner.plan"]
    assert len(planners) > 5
    found = [
        f"{module} reaches {dep}"
        for module in sorted(planners)
        for dep in sorted(_reachable(graph, module) & runs_a_job)
    ]
    assert not found, "the planner reaches what runs a job:\n" + "\n".join(found)
