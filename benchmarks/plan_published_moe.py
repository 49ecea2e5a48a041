"""The published mixture-of-experts figures against the planner: ``benchmarks/plan_published.py``'s
MoE section (its ``--skip-moe`` skips it), kept in a file of its own.

Every ``moe_throughput`` figure of ``published_figures.yaml`` (all held out: no constant is chosen
on any, the cluster presets are as they are) is planned at its published degrees, ep included
(``plan_published.plan_row``), and printed with its error, whether it fits where it ran, the
dominant term and the step's terms; then the held-out median |error| (target <= 15%), how many
runs are predicted to fit (target: all) and the ``moe_pairs`` ratios.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_published import TARGET_MOE_MEDIAN, TARGET_RATIO, _role, plan_row  # noqa: E402

from hsdp_runner.core.errors import ConfigError  # noqa: E402


def moe_published(data: dict) -> None:
    """Print the mixture-of-experts table (``moe_throughput``: every figure held out, no
    constant chosen from any; the cluster presets as they are): per figure the plan row of its
    published layout (``plan_row``: degrees and ep fixed, ``ep_layout`` where the figure has
    one), its tokens/s/GPU against the published, whether it fits where it ran, the dominant
    term and the step's terms; then the held-out median |error|, the fit count and the
    ``moe_pairs`` ratios. A figure the runner refuses (ConfigError) is listed with its reason
    and left out of the median."""
    print(
        f"\nMixture-of-experts figures ({len(data['moe_throughput'])}, all held out; presets "
        "as they are):\n\n| figure | setup | role | published tok/s/GPU | predicted | error | "
        "fits where it ran: published / predicted (GiB) | dominant | step terms (s) | plan (s) "
        "|\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows, refused = {}, {}
    for case in data["moe_throughput"]:
        start = time.perf_counter()
        try:
            rows[case["id"]] = row = plan_row(case)
        except ConfigError as err:
            refused[case["id"]] = str(err)
            print(
                f"| {case['id']} | {case['setup']} | {_role(case)} | "
                f"{case['tokens_per_s_per_gpu']:,} | refused | - | yes / - | - | runner refuses: "
                f"{err} | {time.perf_counter() - start:.0f} |",
                flush=True,
            )
            continue
        error = row["tps_per_device"] / case["tokens_per_s_per_gpu"] - 1
        print(
            f"| {case['id']} | {case['setup']} | {_role(case)} | "
            f"{case['tokens_per_s_per_gpu']:,} | {row['tps_per_device']:,.0f} | {error:+.0%} | "
            f"yes / {'yes' if row['fits'] else 'NO'} ({row['mem_gib']:.1f}) | "
            f"{row['dominant']} | {_terms(row)} | {time.perf_counter() - start:.0f} |",
            flush=True,
        )
    _moe_summary(data, rows, refused)
    _moe_pairs(data, rows, refused)


def _terms(row: dict) -> str:
    """A plan row's step as its terms: compute, each mesh dim's exposed communication (``pp``:
    the stage-to-stage sends) and a pipeline's bubble, in seconds."""
    terms = [f"compute {row['compute_s']:.3g}"]
    terms += [f"{d} {s:.3g}" for d, s in row["exposed_comm_s"].items() if s > 1e-3]
    if row.get("bubble_s"):
        terms.append(f"bubble {row['bubble_s']:.3g}")
    return " + ".join(terms) + f" = {row['step_time_s']:.3g}"


def _moe_summary(data: dict, rows: dict, refused: dict) -> None:
    """Print the held-out median |error| of the planned MoE figures (the refused ones named and
    left out) and how many of them the plan says fit where they ran."""
    errors = {
        c["id"]: abs(rows[c["id"]]["tps_per_device"] / c["tokens_per_s_per_gpu"] - 1)
        for c in data["moe_throughput"]
        if c["id"] in rows and c["role"] == "held_out"
    }
    median = statistics.median(errors.values())
    worst = max(errors, key=errors.get)
    print(
        f"\nHeld-out MoE throughput: {len(errors)} figures planned, median |error| "
        f"{median:.1%} (target <= {TARGET_MOE_MEDIAN:.0%}: "
        f"{'met' if median <= TARGET_MOE_MEDIAN else 'MISSED'}), largest {errors[worst]:.1%} "
        f"({worst})."
    )
    print(_by_precision(data, errors))
    by_reason: dict[str, list[str]] = {}
    for figure, reason in refused.items():
        by_reason.setdefault(reason, []).append(figure)
    for reason, figures in by_reason.items():
        print(f"Refused by the runner, left out of the median: {', '.join(figures)}: {reason}")
    fit = sum(row["fits"] for row in rows.values())
    print(
        f"Fits where it ran: {fit} of {len(rows)} planned runs predicted to fit (target: all)"
        + (
            "; predicted not to fit: "
            + ", ".join(f"{i} ({r['mem_gib']:.1f} GiB)" for i, r in rows.items() if not r["fits"])
            if fit < len(rows)
            else ""
        )
        + "."
    )


def _by_precision(data: dict, errors: dict) -> str:
    """The line that splits the median |error| (``errors``: figure id -> |error|) by the
    precision each figure's overrides set: the FP8 runs' experts ran in FP8 under Transformer
    Engine where the runner keeps them in bf16 (docs/moe.md, "What runs on CPU, what needs a
    GPU"), so their error holds a difference of implementation that the bf16 runs' does not."""
    groups: dict[str, list[float]] = {}
    for case in data["moe_throughput"]:
        if case["id"] in errors:
            (precision,) = [o for o in case["overrides"] if o.startswith("precision=")]
            groups.setdefault(precision, []).append(errors[case["id"]])
    return "By precision: " + "; ".join(
        f"{name}: median |error| {statistics.median(values):.1%} over {len(values)}"
        for name, values in sorted(groups.items())
    )


def _moe_pairs(data: dict, rows: dict, refused: dict) -> None:
    """Per ``moe_pairs`` entry: each figure (an id of a ``moe_throughput`` figure) against its
    pair's first as a ratio of tokens/s/GPU, published vs predicted (the rows ``moe_published``
    planned; a figure not among them planned here from its table entry), and whether the faster
    one is predicted faster."""
    print(
        "\n| MoE pair | figure / base | published ratio | predicted ratio | error | faster "
        "predicted faster |\n|---|---|---|---|---|---|"
    )
    total, kept, refused_pairs = 0, 0, 0
    table = {case["id"]: case for case in data["moe_throughput"]}
    for pair in data["moe_pairs"]:
        base, *others = (table[figure] for figure in pair["figures"])
        for fig in others:
            total += 1
            pub = fig["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            try:
                pred = _moe_tps(fig, pair, rows, refused) / _moe_tps(base, pair, rows, refused)
            except ConfigError:
                refused_pairs += 1
                print(
                    f"| {pair['id']} | {fig['id']} / {base['id']} | {pub:.3f} | refused | - | - |"
                )
                continue
            same_side = (pub > 1) == (pred > 1)
            kept += same_side and abs(pred / pub - 1) <= TARGET_RATIO
            print(
                f"| {pair['id']} | {fig['id']} / {base['id']} | {pub:.3f} | {pred:.3f} | "
                f"{pred / pub - 1:+.0%} | {'yes' if same_side else 'NO'} |"
            )
    print(
        f"\nMoE pairs: {kept} of {total} within {TARGET_RATIO:.0%} of the published ratio with "
        f"the faster one predicted faster ({refused_pairs} with a figure the runner refuses)."
    )


def _moe_tps(fig: dict, pair: dict, rows: dict, refused: dict) -> float:
    """Predicted tokens/s/GPU of the table's figure ``fig`` in ``pair`` (its cluster the
    pair's)."""
    if fig["id"] in refused:
        raise ConfigError(refused[fig["id"]])
    if fig["id"] not in rows:
        rows[fig["id"]] = plan_row({**fig, "cluster": pair["cluster"]})
    return rows[fig["id"]]["tps_per_device"]
