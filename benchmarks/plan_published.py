"""The planner against published figures, fitted and held out, and its own speed at 1,024 ranks.

    python benchmarks/plan_published.py [--skip-dense] [--skip-memory] [--skip-moe] [--skip-speed]

Every figure comes from ``benchmarks/published_figures.yaml`` (source, table, date read), each
marked **fitted** (used to choose one constant) or **held out** (never used to choose anything).
The split is fixed: the A100 presets' ``compute_efficiency`` is chosen on single-node throughput
figures only (MosaicML's MPT 1B-13B on 8 A100s), so every multi-node figure, the ones the
topology model decides, is held out; sm90's (``h100_sxm``, ``h200``) is chosen on none of these
but on this runner's own job measured on one H200 (``planner_gpu_heldout.py fit``), so every
H100 figure is held out, torchtitan's Llama 3.1 8B on 8 H100s (fitted before) too, and is
predicted at the preset's constant; the links' ``nic_efficiency`` is chosen on one nccl-tests
figure and checked on the others. Printed:
1. the link table (nccl-tests bus bandwidths, predicted by ``Cluster.price``);
2. the throughput table (tokens/s/GPU by ``planner.step_time.step_time`` for the published layout);
3. the targets: median absolute error of the held-out throughput <= 20%; for every published
   pair (``pairs``: two or more setups of one model on one cluster from one source, all held
   out), the predicted ratio of tokens/s/GPU within 15% of the published one and the faster one
   predicted faster; and, as a further check, the scaling of one model from one node to many
   (same cluster, same per-GPU batch where published);
4. the memory table (``memory`` figures: published GiB per GPU, or only whether the run fit;
   then every throughput figure as a run that fit where it ran), all held out: the median
   error of the published GiB and how many runs the plan says fit where they ran;
5. the mixture-of-experts table (``moe_throughput``, all held out: no constant is chosen from
   them, the cluster presets are as they are): per figure the plan row of its published layout
   (degrees and ep fixed; ``ep_layout`` where the published layout cannot hold its ep), its
   tokens/s/GPU against the published, whether it fits where it ran, the dominant term and the
   step's terms; the held-out median |error| (target <= 15%), how many runs are predicted to
   fit (target: all), and the ``moe_pairs`` ratios. Figures the runner refuses (ConfigError)
   are listed with the reason and left out of the median;
6. the wall time of cold plans on 1,024 ranks.

``--skip-dense`` skips 1-3 (the dense figures), ``--skip-memory`` 4, ``--skip-moe`` 5 and
``--skip-speed`` 6.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsdp_runner import plan  # noqa: E402
from hsdp_runner.config.compose import to_run_config  # noqa: E402
from hsdp_runner.core.errors import ConfigError  # noqa: E402
from hsdp_runner.distributed.hardware import CACHE_ENV  # noqa: E402
from hsdp_runner.distributed.parallel_dims import ParallelDims  # noqa: E402
from hsdp_runner.distributed.topology import Placement  # noqa: E402
from hsdp_runner.planner import memory as plan_memory  # noqa: E402
from hsdp_runner.planner.cluster import resolve  # noqa: E402
from hsdp_runner.planner.layouts import plan_layouts  # noqa: E402
from hsdp_runner.planner.pipeline import (  # noqa: E402
    pipeline_entries,
    runner_refusal,
    stages_per_rank,
)
from hsdp_runner.planner.step_time import step_time  # noqa: E402

DATA = Path(__file__).with_name("published_figures.yaml")
TARGET_MEDIAN, TARGET_RATIO = 0.20, 0.15
TARGET_MOE_MEDIAN = 0.15  # the held-out median |error| of the mixture-of-experts figures


def load() -> dict:
    """The published figures (see the data file's header)."""
    return yaml.safe_load(DATA.read_text())


def predict_tps(case: dict, efficiency: float | None = None) -> dict:
    """step_time of the published layout of ``case``, with ``efficiency`` if given; a
    pipeline figure (``pp``, ``pp_schedule``) is its plan row (``pipeline_row``)."""
    cfg = plan.compose(
        case["overrides"] + [f"cluster={case['cluster']}", f"cluster.nodes={case['nodes']}"]
    )
    cluster = resolve(to_run_config(cfg).cluster, cfg.precision.param_dtype)
    if efficiency is not None:
        cluster.compute_efficiency = efficiency
    if case.get("pp", 1) > 1:
        return pipeline_row(case, cfg, cluster)
    world = cluster.world_size
    rep, shard, tp = case["layout"]  # (dp_replicate, dp_shard, tp); cp apart, default 1
    dims = ParallelDims(
        dp_replicate=rep,
        dp_shard=shard,
        cp=case.get("cp", 1),
        tp=tp,
        world_size=world,
        ranks_per_node=cluster.gpus_per_node,
    )
    return step_time(cfg, dims, cluster)


def pipeline_row(case: dict, cfg, cluster) -> dict:
    """The plan row of a pipeline figure: its stage layout (``_fixed_degrees``) planned as a
    stage of ``pp`` (``pipeline.pipeline_entries``), under its ``pp_schedule`` at the stages
    per rank the job sets (``pipeline.stages_per_rank``: the figure's ``vpp``, which its
    overrides carry as ``parallel.pp_stages_per_rank``). ConfigError with the runner's reason
    when the runner refuses that pipeline (``pipeline.runner_refusal``); ValueError when the
    figure's ``vpp`` did not reach the plan."""
    fixed = _fixed_degrees(case)
    run = to_run_config(cfg)
    v = stages_per_rank(run, case["pp_schedule"])
    if v != case.get("vpp", v):
        raise ValueError(
            f"{case['id']}: vpp {case['vpp']} is planned at {v} stages per rank; add "
            f"parallel.pp_stages_per_rank={case['vpp']} to its overrides"
        )
    rows = pipeline_entries(
        cfg, cluster, case["pp"], lambda c, cl, **kw: plan_layouts(c, cl, {}, fixed, **kw)
    )
    for row in rows:
        if row["overrides"]["parallel.pp_schedule"] == case["pp_schedule"]:
            return row
    overrides = {
        "parallel.pp": case["pp"],
        **{f"parallel.{name}": degree for name, degree in fixed.items()},
        "parallel.pp_schedule": case["pp_schedule"],
        "parallel.pp_stages_per_rank": v,
        "parallel.pp_microbatches": run.parallel.pp_microbatches or 2 * case["pp"],
    }
    raise ConfigError(
        runner_refusal(run, overrides, cluster)
        or f"no {case['pp_schedule']} row of pp {case['pp']} for {fixed}"
    )


def _fixed_degrees(case: dict) -> dict:
    """The degrees a figure holds fixed: its ``layout`` (dp_replicate, dp_shard, tp), or its
    ``ep_layout`` where it has one (a mixture-of-experts figure whose ``layout`` cannot hold
    its ep: the runner layout to plan), ``cp``, and ``ep`` where it has one."""
    rep, shard, tp = case.get("ep_layout") or case["layout"]
    fixed = {"dp_replicate": rep, "dp_shard": shard, "cp": case.get("cp", 1), "tp": tp}
    if "ep" in case:
        fixed["ep"] = case["ep"]
    return fixed


def efficiency_matching(
    step_at, target: float, lo: float = 0.05, hi: float = 2.0, rel_tol: float = 1e-4
) -> float:
    """The ``compute_efficiency`` e in [``lo``, ``hi``] at which ``step_at(e)`` (a predicted
    step time, or any figure proportional to it) equals ``target``, to ``rel_tol`` of e.

    The predicted step is ``a / e + b``: the GEMMs and attention scale with 1 / e, the memory
    traffic, the step end and the launch floor do not, so it is linear in x = 1 / e where no
    launch floor takes over. Regula falsi on x (the Illinois variant, which keeps a stale end
    from stalling it) finds the root of such a line in one step and needs a few where a floor
    bends it; bisection needed 18 plans. Raises ConfigError when ``target`` is outside what
    [``lo``, ``hi``] reaches."""
    x_lo, x_hi = 1 / hi, 1 / lo  # the step rises with x
    f_lo, f_hi = step_at(hi) - target, step_at(lo) - target
    if not f_lo < 0 < f_hi:
        raise ConfigError(
            f"a step of {target:.4g} is not reached by compute_efficiency in [{lo}, {hi}]"
        )
    stale = 0  # which end was kept last time (-1 low, 1 high)
    while x_hi / x_lo > 1 + rel_tol:
        x = x_lo - f_lo * (x_hi - x_lo) / (f_hi - f_lo)
        f = step_at(1 / x) - target
        if abs(f) <= 1e-9 * target:
            return 1 / x
        if f < 0:
            x_lo, f_lo = x, f
            f_hi = f_hi / 2 if stale == 1 else f_hi
            stale = 1
        else:
            x_hi, f_hi = x, f
            f_lo = f_lo / 2 if stale == -1 else f_lo
            stale = -1
    return 2 / (x_lo + x_hi)


def fit_efficiency(cases: list[dict]) -> float:
    """The compute efficiency at which the median fitted case is predicted exactly: per case
    the efficiency matching its figure (``efficiency_matching``: the step is proportional to
    1 / tokens per second), then the median over the cases."""
    found = [
        efficiency_matching(
            lambda e, case=case: 1 / predict_tps(case, e)["tps_per_device"],
            1 / case["tokens_per_s_per_gpu"],
        )
        for case in cases
    ]
    return statistics.median(found)


def links(data: dict) -> list[tuple]:
    """Rows (case, predicted bus GB/s, error) of the nccl-tests figures."""
    rows = []
    for case in data["links"]:
        cfg = plan.compose(
            [f"cluster={case['cluster']}", "cluster.nodes=2"]
            + [f"cluster.{k}={v}" for k, v in case["overrides"].items()]
        )
        cluster = resolve(to_run_config(cfg).cluster, "bfloat16")
        price = cluster.price(case["kind"], Placement(*case["placement"]), 1, 8e9)
        rows.append((case, price.bus_gbps, price.bus_gbps / case["bus_gbps"] - 1))
    return rows


def _role(case: dict) -> str:
    return f"fitted ({case['fits']})" if case["role"] == "fitted" else "held out"


def published() -> None:
    """Print the link and throughput tables and whether the targets are met."""
    data = load()
    print(f"Published figures read {data['date_read']} ({DATA.name}).\n")
    print(
        "| link figure | setup | role | published GB/s | predicted GB/s | error |\n"
        "|---|---|---|---|---|---|"
    )
    for case, predicted, error in links(data):
        print(
            f"| {case['id']} ({case['source'].split('github.com/')[-1]}) | {case['setup']} | "
            f"{_role(case)} | {case['bus_gbps']:g} | {predicted:.4g} | {error:+.0%} |"
        )
    efficiency = {}
    for cluster in sorted({c["cluster"] for c in data["throughput"]}):
        fitted = [
            c for c in data["throughput"] if c["cluster"] == cluster and c["role"] == "fitted"
        ]
        preset = resolve(to_run_config(plan.compose([f"cluster={cluster}"])).cluster, "bfloat16")
        if not fitted:
            print(
                f"\n{cluster}: no fitted figure; the preset's compute_efficiency "
                f"{preset.compute_efficiency:g} (conf/cluster/{cluster}.yaml says where from)"
            )
            continue
        efficiency[cluster] = fit_efficiency(fitted)
        print(
            f"\n{cluster}: compute_efficiency fitted on {len(fitted)} single-node figure(s) = "
            f"{efficiency[cluster]:.3f} (preset conf/cluster/{cluster}.yaml: "
            f"{preset.compute_efficiency:g})"
        )
    print(
        "\n| figure | setup | role | published tok/s/GPU | predicted | error | step: compute + "
        "exposed comm (s) |\n|---|---|---|---|---|---|---|"
    )
    held, results = [], {}
    for case in data["throughput"]:
        result = predict_tps(case, efficiency.get(case["cluster"]))
        results[case["id"]] = result
        error = result["tps_per_device"] / case["tokens_per_s_per_gpu"] - 1
        if case["role"] == "held_out":
            held.append(abs(error))
        comm = ", ".join(f"{d} {s:.3g}" for d, s in result["exposed_comm_s"].items() if s > 1e-4)
        print(
            f"| {case['id']} | {case['setup']} | {_role(case)} | "
            f"{case['tokens_per_s_per_gpu']:,} | {result['tps_per_device']:,.0f} | "
            f"{error:+.0%} | {result['compute_s']:.3g} + ({comm or '0'}) |"
        )
    median = statistics.median(held)
    print(
        f"\nHeld-out throughput: {len(held)} figures, median |error| {median:.1%} (target <= "
        f"{TARGET_MEDIAN:.0%}: {'met' if median <= TARGET_MEDIAN else 'MISSED'}), largest "
        f"{max(held):.1%}."
    )
    _pairs(data, efficiency)
    _scaling(data, results)


def _pairs(data: dict, efficiency: dict) -> None:
    """Per published pair: each figure against its pair's first, as a ratio of tokens/s/GPU,
    published vs predicted, and whether the faster one is predicted faster."""
    print(
        "\n| pair | figure / base | differs | published ratio | predicted ratio | error | "
        "faster predicted faster |\n|---|---|---|---|---|---|---|"
    )
    missed = []
    for pair in data["pairs"]:
        # A cluster with no fitted figure keeps its preset's efficiency.
        e = efficiency.get(pair["cluster"])
        base, *others = pair["figures"]
        predicted = {
            f["id"]: predict_tps({**f, "cluster": pair["cluster"]}, e)["tps_per_device"]
            for f in pair["figures"]
        }
        for fig in others:
            pub = fig["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            pred = predicted[fig["id"]] / predicted[base["id"]]
            error = pred / pub - 1
            same_side = (pub > 1) == (pred > 1)
            if abs(error) > TARGET_RATIO or not same_side:
                missed.append(f"{fig['id']} / {base['id']}")
            print(
                f"| {pair['id']} | {fig['setup']} / {base['setup']} | {pair['differs']} | "
                f"{pub:.3f} | {pred:.3f} | {error:+.0%} | {'yes' if same_side else 'NO'} |"
            )
    total = sum(len(p["figures"]) - 1 for p in data["pairs"])
    print(
        f"\nPairs: {total - len(missed)} of {total} within {TARGET_RATIO:.0%} of the published "
        f"ratio with the faster one predicted faster"
        + (f"; missed: {', '.join(missed)}." if missed else ".")
    )


def _scaling(data: dict, results: dict) -> None:
    """Ratios between figures of one model on one cluster at different node counts."""
    by_model: dict[tuple, list[dict]] = {}
    for case in data["throughput"]:
        model = tuple(o for o in case["overrides"] if o.startswith("model"))
        by_model.setdefault((case["source"], case["cluster"], model), []).append(case)
    print(
        "\n| scaling (same model, same cluster) | published ratio | predicted | error |\n"
        "|---|---|---|---|"
    )
    for cases in by_model.values():
        base = min(cases, key=lambda c: c["nodes"])
        for case in cases:
            if case is base or case["nodes"] == base["nodes"]:
                continue
            pub = case["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            pred = results[case["id"]]["tps_per_device"] / results[base["id"]]["tps_per_device"]
            print(
                f"| {case['id']} / {base['id']} | {pub:.3f} | {pred:.3f} | {pred / pub - 1:+.0%} |"
            )


def plan_row(case: dict, cluster_name: str | None = None) -> dict:
    """The plan's row of the published layout of ``case`` (degrees fixed: ``_fixed_degrees``;
    a pipeline figure's ``pipeline_row``), on the GPUs it ran on (``device_gib`` where they
    differ from the cluster preset); ConfigError where the runner refuses the layout."""
    cfg = plan.compose(
        case["overrides"]
        + [f"cluster={cluster_name or case['cluster']}", f"cluster.nodes={case['nodes']}"]
    )
    cluster = resolve(to_run_config(cfg).cluster, cfg.precision.param_dtype)
    if case.get("device_gib"):
        cluster.device_memory_gib = case["device_gib"]
    if case.get("pp", 1) > 1:
        return pipeline_row(case, cfg, cluster)
    return plan_layouts(cfg, cluster, {}, _fixed_degrees(case))[0]


def memory(data: dict) -> None:
    """Print the published memory table: every ``memory`` figure, then every throughput figure
    as a run that fit where it ran; the median error of the published GiB and the fit column.

    What is compared: the plan's peak is tensor memory (what ``max_memory_allocated`` counts)
    plus the cluster's ``memory_reserve_gib`` (2 GiB); torchtitan logs
    ``max_memory_reserved``, which also holds the caching allocator's cached free blocks, so a
    prediction below the published figure by a few GiB is what an exact tensor count gives."""
    runs = [
        {**c, "published_gib": None, "ran": True, "table": "throughput figure (it ran)"}
        for c in data["throughput"]
    ] + [
        {**f, "cluster": p["cluster"], "published_gib": None, "ran": True, "source": p["source"]}
        for p in data["pairs"]
        for f in p["figures"]
    ]
    print(
        "\n| memory figure | setup | role | published GiB (max reserved) | predicted GiB "
        "(tensors + reserve) | error | peak phase | fits where it was run: published / "
        "predicted |\n|---|---|---|---|---|---|---|---|"
    )
    errors, fit_right, fit_all, seen = [], 0, 0, set()
    for case in data["memory"] + runs:
        if case["id"] in seen:
            continue
        seen.add(case["id"])
        row = plan_row(case)
        mem, breakdown = row["mem_gib"], row["memory"]
        pub = case["published_gib"]
        error = "" if pub is None else f"{mem / pub - 1:+.0%}"
        if pub is not None:
            errors.append(abs(mem / pub - 1))
        fit_all += 1
        fit_right += row["fits"] == case["ran"]
        capacity = case.get("device_gib") or resolve_capacity(case)
        extra = f" (not modelled: {case['not_modelled']})" if case.get("not_modelled") else ""
        print(
            f"| {case['id']} | {case['setup']}{extra} | held out | "
            f"{'-' if pub is None else pub} | {mem:.1f} | {error} | {breakdown['peak_phase']} | "
            f"{'yes' if case['ran'] else 'no (OOM)'} / {'yes' if row['fits'] else 'NO'} "
            f"(of {capacity:.1f}) |",
            flush=True,
        )
    print(
        f"\nPublished memory: {len(errors)} held-out figures, median |error| "
        f"{statistics.median(errors):.1%}, largest {max(errors):.1%} (predicted tensor peak + "
        f"reserve against torchtitan's max reserved). Fits where it was run: {fit_right} of "
        f"{fit_all} agree with what the source reports."
    )


def resolve_capacity(case: dict) -> float:
    """The device memory of the cluster preset ``case`` ran on, in GiB."""
    cfg = plan.compose([f"cluster={case['cluster']}"])
    return resolve(to_run_config(cfg).cluster, "bfloat16").device_memory_gib


def speed() -> None:
    """Print the wall time of a cold plan of 8B and 70B on 1,024 ranks."""
    for model, batch in (("llama3_8b", 1024), ("llama3_70b", 1024)):
        with tempfile.TemporaryDirectory() as cache:
            before = os.environ.get(CACHE_ENV)
            os.environ[CACHE_ENV] = cache  # a cold cache: every fake measurement made afresh
            start, cpu = time.perf_counter(), _cpu_seconds()
            _, entries = plan.predict(
                plan.compose(
                    [
                        f"model={model}",
                        "precision=bf16",
                        f"trainer.global_batch_size={batch}",
                        "parallel.ac=selective",
                        "cluster=h100_sxm",
                        "cluster.nodes=128",
                    ]
                ),
                {},
            )
            took = time.perf_counter() - start
            # The measuring children live as long as the planning process; a plan started from
            # the command line ends them with itself, and their CPU counts once they have ended.
            plan_memory.release_children()
            cpu = _cpu_seconds() - cpu
            if before is None:
                os.environ.pop(CACHE_ENV)
            else:
                os.environ[CACHE_ENV] = before
        valid = sum(e["valid"] for e in entries)
        print(
            f"{model} on 1,024 ranks: {len(entries)} layouts ({valid} valid) planned in "
            f"{took:.1f} s wall, {cpu:.1f} s CPU incl. the measuring children (cold cache; "
            f"load average {os.getloadavg()[0]:.1f})",
            flush=True,
        )


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (load-independent, unlike wall)."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-dense", action="store_true", help="skip the dense figures")
    parser.add_argument("--skip-moe", action="store_true", help="skip the MoE figures")
    args = parser.parse_args()
    if not args.skip_dense:
        published()
    if not args.skip_moe:
        from plan_published_moe import moe_published  # beside this file

        moe_published(load())
    if not args.skip_memory:
        memory(load())
    if not args.skip_speed:
        speed()
