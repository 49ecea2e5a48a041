"""The planner's outputs: the ranking, the table, plan.md / plan.json and the planned sweep.

plan.json (version 1) holds ``model``, ``world_size``, ``cluster`` and one entry per layout:
``overrides`` (dotted key -> value: the degrees and any axes), ``valid``, ``reason``,
``fits``, ``mem_gib``, ``step_time_s``, ``tps_per_device``, ``mfu``, ``dominant``, ``rank``
(1-based; null when invalid), plus the breakdowns (``memory``: the peak's parts, the phase of
the step it falls in, ``peak_phase``, and every phase's GiB, ``phase_gib``; ``compute_s``,
``exposed_comm_s``) and ``comm_links``: per communication term the group's placement on the
nodes, the link, the algorithm and the bus bandwidth assumed (plan.md shows them for the best
layout); plan.md's assumptions also say how old this machine's measured peak is and how loaded
the machine was then (``cluster=this_machine``: ``Cluster.peak_load``). The sweep YAML runs the ``plan.top_k`` best layouts that fit, each job
carrying ``plan.source`` = the absolute path of plan.json, so ``compare`` finds its prediction.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.cpu_peak import MachineLoad
from hsdp_runner.planner.degrees import PLANNED_DIMS

PLAN_JSON, PLAN_MD = "plan.json", "plan.md"
DEGREE_KEYS = tuple(f"parallel.{name}" for name in PLANNED_DIMS)
GROUPS = ("parallel", "model", "precision", "optim", "data", "logger", "launcher")


def rank(entries: list[dict]) -> None:
    """Sort in place (fitting layouts by step time, then those that do not fit, then invalid)
    and number the valid ones 1..n."""
    entries.sort(key=lambda e: (not e["valid"], not e["fits"], e["step_time_s"] or 0.0))
    for i, entry in enumerate(e for e in entries if e["valid"]):
        entry["rank"] = i + 1


def _degrees(entry: dict) -> str:
    o = entry["overrides"]  # plan.json files written before the cp dim have no parallel.cp
    # ep only where planned (a model with experts): rep×shard×cp×tp×ep.
    keys = DEGREE_KEYS if "parallel.ep" in o else DEGREE_KEYS[:-1]
    return "×".join(str(o.get(key, 1)) for key in keys)


def _axes(entry: dict) -> str:
    extra = {k: v for k, v in entry["overrides"].items() if k not in DEGREE_KEYS}
    text = " ".join(f"{k.removeprefix('parallel.')}={v}" for k, v in extra.items())
    if entry.get("bubble_fraction") is not None:  # a pipeline layout (planner/pipeline.py)
        text += f" (bubble {entry['bubble_fraction']:.0%}: {entry['bubble_s']:.3g} s)"
    return text


def _dominant(entry: dict) -> str:
    name = entry["dominant"]
    if name in ("compute", "step_end", "bubble"):  # bubble: pipeline layouts (pipeline.py)
        return f"{name.replace('_', ' ')} {entry[name + '_s'] / entry['step_time_s']:.0%}"
    seconds = entry["exposed_comm_s"][name.split(":")[1]]
    return f"{name.replace('comm:', 'comm ')} {seconds / entry['step_time_s']:.0%}"


def _peak_phase(entry: dict) -> str:
    # plan.json files written before the phases were recorded have no peak phase.
    return entry.get("memory", {}).get("peak_phase", "")


def table(entries: list[dict], cluster: dict) -> str:
    """The ranked markdown table: one row per layout, invalid ones last with their reason."""
    head = (
        "| rank | degrees (rep×shard×cp×tp[×ep]) | axes | mem GiB/rank | memory peak | step s "
        "| tok/s/device | MFU | compute s | step end s | exposed comm s | dominant |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for e in entries:
        if not e["valid"]:
            rows.append(
                f"| — | {_degrees(e)} | {_axes(e)} | invalid: "
                f"{e['reason'].replace('|', '/')} | | | | | | | | |"
            )
            continue
        mem = f"{e['mem_gib']:.2f}" + (
            "" if e["fits"] else f" (does not fit {cluster['device_memory_gib']:.1f})"
        )
        comm = sum(e["exposed_comm_s"].values())
        rows.append(
            f"| {e['rank']} | {_degrees(e)} | {_axes(e)} | {mem} | {_peak_phase(e)} | "
            f"{e['step_time_s']:.4g} | {e['tps_per_device']:,.0f} | {e['mfu']:.1%} | "
            f"{e['compute_s']:.4g} | {e['step_end_s']:.3g} | {comm:.3g} | {_dominant(e)} |"
        )
    return "\n".join(rows)


def _assumptions(cfg: RunConfig, cluster: dict) -> str:
    layers = list(cfg.plan.layers_measured)
    lines = [
        f"- Cluster `{cluster['name']}`: {cluster['nodes']} node(s) x {cluster['gpus_per_node']}"
        f" ranks, {cluster['device_memory_gib']:.1f} GiB each, peak {cluster['peak_tflops']:.4g}"
        f" TFLOP/s ({cluster['peak_source']}), compute efficiency "
        f"{cluster['compute_efficiency']:.3g}, overlap {cluster['overlap']:.2g}"
        + (f", calibrated from {cluster['calibrated_from']}" if cluster["calibrated_from"] else "")
        + ".",
        *_peak_load_line(cluster),
        f"- Memory: the runner's model and sharding under a fake process group, tracked by "
        f"FSDPMemTracker with {', '.join(map(str, layers))} block(s), phase by phase (forward "
        "and backward of the embedding, the first, interior and last blocks and the output, "
        "the loss, the gradient reduction); each phase extrapolated per block "
        f"to {cfg.model.n_layers} by the measured growth of what it holds of the other "
        "blocks, the peak the largest phase (named in the table); flash attention forced (no "
        "seq x seq scores, as on GPU); sharded state rescaled to each layout by exact "
        "arithmetic; AdamW moments added, the optimizer step a phase of its own; "
        f"{cluster['memory_reserve_gib']:.1f} GiB allocator reserve.",
        "- Step time: compute + the step end (clipping and fused AdamW over the rank's "
        f"trainable shard at {cluster['memory_gbps']:.4g} GB/s memory bandwidth) + exposed "
        "communication (hsdp_runner/planner/step_time.py).",
        f"- Links: {_links_line(cluster)} Every collective is priced as NCCL's ring (ring "
        "factor (n-1)/n, all-reduce 2(n-1)/n); NCCL's tree all-reduce, which it may pick on two "
        "nodes or for small messages, is not modelled (the ring is an upper bound there).",
    ]
    return "\n".join(lines)


def _peak_load_line(cluster: dict) -> list[str]:
    """The line saying how old this machine's measured peak is and how loaded the machine was
    then (``cpu_peak.MachineLoad``); none for a peak from a table or the config."""
    load = MachineLoad.from_record(cluster.get("peak_load"))
    if load is None:
        return []
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(load.measured_at))
    busy = (
        ": other processes kept the CPUs busy, so the peak and every step time are "
        "pessimistic; the next plan measures again"
        if load.busy
        else ""
    )
    return [f"- The peak was measured {load.age()} ({stamp}), {load.describe()}{busy}."]


def _cp_line(cfg: RunConfig, entries: list[dict]) -> str:
    """Which context-parallel degrees were enumerated, and how they were predicted."""
    cps = sorted({e["overrides"].get("parallel.cp", 1) for e in entries})
    how = (
        "the value of plan.cp_degrees"
        if cfg.plan.cp_degrees is not None
        else f"every one that splits model.seq_len={cfg.model.seq_len} into 2 x cp chunks inside a node"
    )
    return (
        f"- Context parallel: cp = {', '.join(map(str, cps))} ({how}); each cp rank measured "
        "on seq_len / cp tokens, its key/value exchange exposed in the step time."
    )


def _links_line(cluster: dict) -> str:
    if cluster["measured_links"] or cluster["nvlink_gbps"] is None:
        return (
            "measured on this machine per collective and group size (linkbench); groups "
            'spanning "nodes" of this one machine use the same table.'
        )
    line = (
        f"inside a node NVLink, {cluster['nvlink_gbps']:g} GB/s per GPU and direction x "
        f"{cluster['nvlink_efficiency']:g} = "
        f"{cluster['nvlink_gbps'] * cluster['nvlink_efficiency'] * cluster['link_scale']:.4g}"
        " GB/s bus bandwidth."
    )
    if cluster["nics_per_node"]:
        share = (
            cluster["nics_per_node"]
            * cluster["nic_gbit"]
            / 8
            * cluster["nic_efficiency"]
            / cluster["gpus_per_node"]
            * cluster["link_scale"]
        )
        line += (
            f" Across nodes: {cluster['nics_per_node']} NICs x {cluster['nic_gbit']:g} Gb/s"
            f" x {cluster['nic_efficiency']:g} per node / {cluster['gpus_per_node']} GPUs = "
            f"{share:.4g} GB/s per GPU; a ring whose group has k ranks on each node gets "
            "min(k x that, NVLink)."
        )
    return line


def links_table(entry: dict) -> str:
    """Per communication term of one layout: the group's shape on the nodes, the link and
    algorithm assumed, the bus bandwidth and the seconds (none hidden)."""
    rows = [
        "| term | ranks per group | k (ranks/node) | groups per node | nodes per group | "
        "link | algorithm | bus GB/s | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, f in sorted(entry.get("comm_links", {}).items()):
        rows.append(
            f"| {key} | {f['size']} | {f['ranks_per_node']} | {f['groups_per_node']} | "
            f"{f['nodes']} | {f['link']} | {f['algorithm']} | {f['bus_gbps']:.4g} | "
            f"{f['seconds']:.4g} |"
        )
    return "\n".join(rows)


def write(
    out_dir: Path,
    cfg: RunConfig,
    cluster: dict,
    entries: list[dict],
    overrides: list[str],
    axes: dict,
) -> list[Path]:
    """Write plan.md, plan.json (and the sweep with ``plan.write_sweep``); return the paths.
    ConfigError where one exists already (``check_targets``): nothing is overwritten."""
    check_targets(cfg, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_json = (out_dir / PLAN_JSON).resolve()
    data = {
        "version": 1,
        "model": cfg.model.name,
        "world_size": cluster["world_size"],
        "cluster": cluster,
        "overrides": overrides,
        "axes": axes,
        "layouts": entries,
    }
    plan_json.write_text(json.dumps(data, indent=1, default=str))
    md = (
        f"# Plan: {cfg.model.name} on {cluster['world_size']} ranks ({cluster['name']})\n\n"
        f"Command-line overrides: `{' '.join(overrides) or '(none)'}`\n\n"
        f"{_assumptions(cfg, cluster)}\n{_cp_line(cfg, entries)}\n\n"
        f"{table(entries, cluster)}\n"
    )
    best = next((e for e in entries if e["valid"] and e.get("comm_links")), None)
    if best is not None:
        md += (
            f"\n## Links of rank {best['rank']} ({f'{_degrees(best)} {_axes(best)}'.strip()})"
            "\n\n"
            f"{links_table(best)}\n"
        )
    (out_dir / PLAN_MD).write_text(md)
    paths = [out_dir / PLAN_MD, plan_json]
    if cfg.plan.write_sweep:
        paths += write_sweep(
            Path(cfg.plan.write_sweep), cfg, cluster, entries, overrides, plan_json
        )
    return paths


def check_targets(cfg: RunConfig, out_dir: Path) -> None:
    """Raise ConfigError naming the key and the fix when a file the plan would write into
    ``out_dir`` or ``plan.write_sweep`` exists already: checked before planning (minutes for a
    large model) and again before writing, so that nothing saved before is overwritten."""
    for path in (out_dir / PLAN_JSON, out_dir / PLAN_MD):
        if path.exists():
            raise ConfigError(
                f"plan.out_dir={out_dir} already holds {path.name}; choose another "
                "plan.out_dir (or leave it unset for a new time-stamped one)"
            )
    if cfg.plan.write_sweep:
        path = Path(cfg.plan.write_sweep)
        for existing in (path, sweep_layout_dir(path)):
            if existing.exists():
                raise ConfigError(
                    f"plan.write_sweep={path}: {existing} exists already; choose another "
                    f"plan.write_sweep, or move the old sweep away first"
                )


def sweep_layout_dir(path: Path) -> Path:
    """The folder of layout configs that a sweep file written at ``path`` names."""
    return path.parent / f"{path.stem}_layouts"


def write_sweep(
    path: Path,
    cfg: RunConfig,
    cluster: dict,
    entries: list[dict],
    overrides: list[str],
    plan_json: Path,
) -> list[Path]:
    """Write a Hydra sweep of the top-k fitting layouts: ``path`` plus ``<stem>_layouts/``."""
    top = [e for e in entries if e["valid"] and e["fits"]][: cfg.plan.top_k]
    layout_dir = sweep_layout_dir(path)
    group = layout_dir.name
    layout_dir.mkdir(parents=True)
    names = []
    for entry in top:
        name = f"rank{entry['rank']}"
        body = {}
        for key, value in entry["overrides"].items():
            OmegaConf.update(node := OmegaConf.create(body), key, value, merge=True)
            body = OmegaConf.to_container(node)
        (layout_dir / f"{name}.yaml").write_text(
            "# @package _global_\n" + f"# predicted rank {entry['rank']}: step "
            f"{entry['step_time_s']:.4g} s, {entry['mem_gib']:.2f} GiB per rank\n"
            + yaml.safe_dump(body, sort_keys=False)
        )
        names.append(name)
    choices = [item.split("=", 1) for item in overrides if "=" in item]
    defaults = ["config", {group: names[0]}] + [
        {f"override {key}": value} for key, value in choices if key in GROUPS
    ]
    defaults.append("_self_")
    body = OmegaConf.create(
        {
            "plan": {"source": str(plan_json)},
            "launcher": {"nnodes": cluster["nodes"], "nproc_per_node": cluster["gpus_per_node"]},
        }
    )
    for item in overrides:
        key, _, value = item.partition("=")
        if "." in key and key.split(".")[0] not in ("cluster", "plan", "hydra", "launcher"):
            OmegaConf.update(body, key, yaml.safe_load(value), merge=True)
    text = (
        f"# Planned by python -m hsdp_runner.plan {' '.join(overrides)}\n"
        f"# The {len(names)} best layouts that fit, predicted in {plan_json}.\n"
        f"#   python -m hsdp_runner --config-dir {path.parent} --config-name {path.stem}\n"
        + yaml.safe_dump({"defaults": defaults}, sort_keys=False)
        + yaml.safe_dump(OmegaConf.to_container(body), sort_keys=False)
        + yaml.safe_dump(
            {
                "hydra": {
                    "mode": "MULTIRUN",
                    "sweep": {"dir": "multirun/${now:%Y-%m-%d_%H-%M-%S}_" + path.stem},
                    "sweeper": {"params": {group: ",".join(names)}},
                }
            },
            sort_keys=False,
        )
    )
    path.write_text(text)
    return [path, layout_dir]
