"""Every function that takes a config says which schema dataclass it reads.

The config is converted once into the schema dataclasses (``config.compose.to_run_config``) and
travels typed: a parameter holding the whole config or one of its sections is annotated with
its schema class (``RunConfig``, ``ParallelConfig``, a model family's config...), not left bare,
not ``Any``, and not a union with ``dict`` or ``DictConfig``. Pure ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hsdp_runner"

# Section names that, as a parameter, always hold that section of the config.
SECTIONS = {"parallel", "precision", "optim", "launcher", "logger", "fault", "profile"}
# Section names other objects share (the Trainer, batches, plan.json, the planner's Cluster...):
# such a parameter must say what it is, but may be something else. ``model`` (the nn.Module
# everywhere; a model config is spelled ``model_cfg``) and ``device`` are not checked.
SHARED = {"trainer", "train", "data", "metrics", "checkpoint", "plan", "cluster"}
# Annotations that say nothing about which config is read.
LOOSE = {"Any", "dict", "Dict", "DictConfig", "object"}

# The only parameters that may hold the config untyped, each with why. Key:
# "<path under hsdp_runner>::<function>(<parameter>)".
ALLOWED = {
    # Hydra entry points: Hydra hands over the composed DictConfig (with its ``hydra`` node).
    "runtime/app.py::run_info_from_hydra(cfg)": "reads the hydra node Hydra composed",
    "runtime/app.py::hydra_task(cfg)": "the @hydra.main task",
    "report/dashboard/callback.py::on_multirun_start(config)": "Hydra callback API",
    "report/dashboard/callback.py::on_job_end(config)": "Hydra callback API",
    "report/dashboard/callback.py::on_multirun_end(config)": "Hydra callback API",
    # The launcher: it writes parallel=auto's choice into the composed config and sends the
    # workers its plain resolved container (spawned workers have no Hydra context); each worker
    # converts it once, on arrival.
    "runtime/prelaunch.py::validate(cfg)": "the app's DictConfig or a RunConfig; converted here",
    "runtime/auto_job.py::settle(cfg)": "parallel=auto writes its choice into it",
    "runtime/auto_job.py::_plan_on_rank_0(cfg)": "parallel=auto writes its choice into it",
    "runtime/auto_job.py::plan_here(cfg)": "parallel=auto writes its choice into it",
    "runtime/auto_job.py::submitted_job_dir(cfg)": "reads the hydra node of a sweep job",
    "runtime/launch.py::run_job(cfg)": "Hydra's task body: the composed config",
    "runtime/prelaunch.py::check_before_submit(sweep_config)": "Hydra's sweep config",
    "runtime/launch.py::_record_skipped(cfg)": "a sweep job's composed config",
    # The planner: axes are dotted-key overrides of the composed config; each candidate is
    # converted once (planner/axes.axis_configs) and planned typed from there.
    "plan.py::check_axes(cfg)": "axis values composed as overrides",
    "plan.py::predict(cfg)": "varies the composed config by axis",
    "planner/axes.py::check_axis_keys(cfg)": "axis keys are keys of the composed config",
    "planner/axes.py::axis_configs(cfg)": "applies the axes, converts each candidate",
    "planner/layouts.py::plan_layouts(cfg)": "a Scenario of the composed config",
    "planner/pipeline.py::pipeline_entries(cfg)": "a stage's copy of the composed config",
    "planner/pipeline.py::_stage_config(cfg)": "makes the stage's copy of the composed config",
    "planner/auto.py::plan_job(cfg)": "writes the plan's choice into the composed config",
    "planner/auto.py::plan_with_pipelines(cfg)": "copies of the composed config: a flat one and its stages",
    "planner/auto.py::apply_choice(cfg)": "writes the plan's choice into the composed config",
    "planner/auto.py::apply_choice(node)": "a preset's node, or the dict rank 0 published",
    "planner/auto.py::adopt_plan(cfg)": "writes the plan's choice into the composed config",
    "planner/auto.py::remedies(cfg)": "Scenarios of changed copies of the composed config",
    "planner/auto.py::fits_nowhere(cfg)": "hands it to remedies",
    # A fake memory measurement is plain data: hashed for the on-disk cache, sent to a child.
    "planner/memory.py::request(parallel)": "plain request data",
    "planner/memory.py::request(precision)": "plain request data",
    # The conversion itself, and the checks of the plain form it runs first.
    "config/compose.py::to_run_config(cfg)": "the converter",
    "config/checks.py::_reject_unknown_keys(cfg)": "checks the plain form before converting",
    "models/base.py::model_fields(model_cfg)": "a stored copy (checkpoint manifest) or typed",
    "models/base.py::model_spec(model_cfg)": "builds the family config from a stored copy",
    "models/base.py::family_schema(model_cfg)": "the schema a stored copy's _target_ names",
    # Records of finished runs: the resolved config as a job stored it (config_resolved.yaml,
    # W&B's run config), read back by reports, written by earlier versions too.
    "report/prediction.py::_select(config)": "a stored config",
    "report/prediction.py::job_prediction(config)": "the recorded config",
    "report/prediction.py::_job_values(config)": "a stored config",
    "train/sinks.py::open_trackers(config)": "the config W&B records",
    "train/sinks.py::__init__(config)": "the config W&B records",
    "train/sinks.py::_start(config)": "the config W&B records",
}


def _names(node: ast.AST | None) -> set[str]:
    """Every name an annotation mentions (``Optional[ParallelConfig]`` -> both names)."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        node = ast.parse(node.value, mode="eval")
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


def _union_members(node: ast.AST | None) -> set[str]:
    """The outer name of each member of a union annotation (``A | dict[str, int]`` -> A, dict;
    ``Optional[A]`` -> A, None); a single annotation is a union of one."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        node = ast.parse(node.value, mode="eval").body
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_members(node.left) | _union_members(node.right)
    if isinstance(node, ast.Subscript):
        outer = _union_members(node.value)
        if outer & {"Union", "Optional"}:
            inner = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return set().union(*(_union_members(e) for e in inner))
        return outer
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return {"None"} if isinstance(node, ast.Constant) and node.value is None else set()


def schema_classes(package: Path = PACKAGE) -> set[str]:
    """``RunConfig``, the classes its fields are typed with, and every model family's config."""
    tree = ast.parse((package / "config" / "schema.py").read_text())
    run = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunConfig")
    found = {"RunConfig"}
    for field in run.body:
        if isinstance(field, ast.AnnAssign):
            found |= {name for name in _names(field.annotation) if name.endswith("Config")}
    for path in (package / "models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and "ModelConfig" in _names(ast.Tuple(node.bases)):
                found.add(node.name)
    return found


def _holds_config(name: str) -> bool:
    return (
        name in ("cfg", "config")
        or name.startswith("cfg_")
        or name.endswith(("_cfg", "_config"))
        or name in SECTIONS
    )


def untyped_config_parameters(source: str, where: str, schemas: set[str]) -> list[str]:
    """'<where>::<function>(<parameter>): <what is wrong>' for every parameter of ``source``
    that holds a config without its schema class, or whose annotation mixes a schema class
    with ``dict``/``DictConfig``/``Any``."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            names, members = _names(arg.annotation), _union_members(arg.annotation)
            key = f"{where}::{node.name}({arg.arg})"
            if _holds_config(arg.arg) and not names & schemas:
                problems.append(f"{key}: annotate it with the schema class it reads")
            elif arg.arg in SHARED and arg.annotation is None:
                problems.append(f"{key}: unannotated")
            elif members & schemas and members & LOOSE:
                problems.append(f"{key}: a schema class or {sorted(members & LOOSE)}: pick one")
    return problems


def test_every_parameter_holding_a_config_names_its_schema_class():
    schemas = schema_classes()
    assert {"RunConfig", "ParallelConfig", "FaultConfig", "LlamaConfig", "GPT2Config"} <= schemas
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        problems += untyped_config_parameters(path.read_text(), where, schemas)
    unexpected = [p for p in problems if p.split(": ")[0] not in ALLOWED]
    assert not unexpected, "config parameters without their schema class:\n" + "\n".join(unexpected)
    stale = set(ALLOWED) - {p.split(": ")[0] for p in problems}
    assert not stale, f"ALLOWED names parameters that are typed now (or gone): {sorted(stale)}"


def test_the_check_flags_a_bare_a_loose_and_a_mixed_config_parameter():
    source = (
        "def a(cfg): ...\n"
        "def b(parallel: dict): ...\n"
        "def c(model_cfg: 'ModelConfig | dict'): ...\n"
        "def d(trainer): ...\n"
        "def e(cfg: RunConfig, trainer: Trainer, model_cfg: Optional[ModelConfig]): ...\n"
        "def f(pairs: list[tuple[dict, RunConfig]], precision: Union[PrecisionConfig, Any]): ...\n"
    )
    schemas = {"RunConfig", "ModelConfig", "PrecisionConfig"}
    found = untyped_config_parameters(source, "x.py", schemas)
    assert [p.split(": ")[0] for p in found] == [
        "x.py::a(cfg)",
        "x.py::b(parallel)",
        "x.py::c(model_cfg)",
        "x.py::d(trainer)",
        "x.py::f(precision)",
    ]
