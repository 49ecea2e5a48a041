"""`hsdp_runner.parity`: every layout trains the same model as a single process.

One parity run per model family (6 steps, fp32) is shared by the tests below; they also check
that each preset trained (loss down, metrics, logs) through the runner's job path (validation,
``run_job``, ``run_worker`` on every rank), its ranks forked by tests/distributed.py instead of started by
torch's elastic launch, which the CLI tests (test_cli.py, test_faults.py, ...) prove. Tiny
Llama runs every preset: cp alone (2 ranks) and cp with sequence-parallel TP (2 x 2: each cp
rank's tokens split again over tp); `make parity` adds cp = 4, fsdp_cp and hsdp_cp_tp. Tiny
GPT-2 runs the presets that reach every part of its seam: ddp (whole replicas), hsdp_tp (its
TP/SP plan, FSDP2 units on a 2-D mesh) and cp (learned positions in head-tail order); fsdp_tp
(strided sharding) is checked by its resharding test in test_checkpoint.py, and `make parity
PARITY_ARGS=model=gpt2_tiny` runs all of them (docs/layouts_and_parity.md).
The DDP-implementation, HSDP-over-cp, bf16 and gradient-accumulation comparisons (each
``trainer.accum_reduce`` against one micro-batch, and the tensor peak falling with more
micro-batches), which are about the numerics and not the job path, train in one set of four
in-process workers.
"""

import contextlib
import io
import os
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import METERS_OFF, REPO, read_job
from distributed import forked_launcher, run_workers
from test_config import compose

from hsdp_runner import parity as parity_cli
from hsdp_runner.distributed.hardware import cpu_threads

WORLD = {
    "single": 1,
    "ddp": 2,
    "fsdp": 4,
    "hsdp": 4,
    "tp": 2,
    "fsdp_tp": 4,
    "hsdp_tp": 8,
    "cp": 2,
    "cp:parallel.tp=2": 4,
    "fsdp:parallel.dp_shard=2:parallel.ep=2": 2,
}
METRIC_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "step_time_s",
    "tps_per_device",
    "tps_global",
    "tflops",
    "mfu",
    "mem_peak_gib",
}
# The per-step TP layouts dominate the run's cost; 6 steps at a tiny model's learning rate
# (LR below; the default suits the 20-step default job) still move the loss by > 0.3.
STEPS = 6
LR = ["optim.lr=3e-3", "optim.warmup_steps=2"]
BF16_STEPS = 20


def rel_diffs(a, b, key="loss"):
    return [abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b)]


# One family each (the second one, GPT-2, came in through the model seam alone): its layouts.
MODELS = {
    "llama3_tiny": tuple(layout for layout in WORLD if "ep=" not in layout),
    "gpt2_tiny": ("single", "ddp", "hsdp_tp", "cp"),
    # The mixture of experts through the job path with expert parallel; its other layouts train
    # in-process workers (``ep_runs``: four ranks, and two for a step's own mechanics) against it.
    "moe_tiny": ("single", "fsdp:parallel.dp_shard=2:parallel.ep=2"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def parity(request, tmp_path_factory):
    """``hsdp_runner.parity`` over one tiny model's layouts, each job through the runner's job
    path with its ranks forked by ``distributed.forked_launcher``: (output dir, the
    exit code and what the parity run printed, the layouts)."""
    out = tmp_path_factory.mktemp(f"parity_{request.param}")
    layouts = MODELS[request.param]
    printed, errors = io.StringIO(), io.StringIO()
    with forked_launcher(), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = parity_cli.main(
            [
                "--steps",
                str(STEPS),
                "--layouts",
                ",".join(layouts),
                "--out",
                str(out),
                f"model={request.param}",
                *LR,
                *METERS_OFF,  # losses are the point here; test_comm and others check the meters
            ]
        )
    result = SimpleNamespace(returncode=code, stdout=printed.getvalue(), stderr=errors.getvalue())
    return out, result, layouts


@pytest.mark.multiprocess
def test_every_layout_matches_single_process_within_1e5(parity):
    out, result, layouts = parity
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (out / "parity.md").read_text()
    for layout in layouts:
        assert f"| {layout} | {WORLD[layout]} |" in table and table.count("PASS") == len(layouts)
    base, _ = read_job(out / "single")
    for layout in layouts:
        records, summary = read_job(out / layout.replace(":", "+"))
        assert len(records) == STEPS
        assert max(rel_diffs(records, base)) <= 1e-5, layout
        assert max(rel_diffs(records, base, "grad_norm")) <= 1e-5, layout
        validated = [(r, b) for r, b in zip(records, base) if "val_loss" in b]
        assert [b["step"] for _, b in validated] == [STEPS // 2, STEPS], layout
        assert all(abs(r["val_loss"] - b["val_loss"]) <= 1e-5 * b["val_loss"] for r, b in validated)
        assert (
            abs(summary["eval_loss"] - read_job(out / "single")[1]["eval_loss"])
            <= 1e-5 * summary["eval_loss"]
        )


@pytest.mark.multiprocess
def test_each_preset_trained_through_the_job_path(parity):
    out, _, layouts = parity
    for layout in layouts:
        job = out / layout.replace(":", "+")
        records, summary = read_job(job)
        assert METRIC_KEYS <= set(records[0]), layout
        assert records[-1]["loss"] < records[0]["loss"] - 0.3, layout
        assert summary["status"] == "completed" and summary["world_size"] == WORLD[layout]
        assert summary["mesh_dim_names"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
        assert summary["median_tps_global"] > 0 and summary["steady_steps"] == STEPS - 2
        assert len(list((job / "logs").glob("rank*.log"))) == WORLD[layout]
        # The launcher's share of the CPUs is each job's own: the single-process job before
        # this one (every CPU) must not leave its thread count to this job's ranks.
        threads = os.environ.get("OMP_NUM_THREADS") or cpu_threads(WORLD[layout], env={})
        assert summary["cpu_threads"] == int(threads), layout


@pytest.mark.multiprocess
@pytest.mark.parametrize("parity", ["llama3_tiny"], indirect=True)
def test_fsdp_and_hsdp_are_identical_at_step_one(parity):
    out, _, _ = parity
    fsdp, _ = read_job(out / "fsdp")
    hsdp, _ = read_job(out / "hsdp")
    assert fsdp[0]["loss"] == hsdp[0]["loss"]
    assert fsdp[0]["grad_norm"] == pytest.approx(hsdp[0]["grad_norm"], rel=1e-6)


# What every ``_train_cases`` case starts from (its overrides come after).
# The meters off unless a case turns one on: the communication count runs step 1 under a
# dispatch mode that sees every op (a tenth of a 4-rank fixture's CPU), and no case here
# reads it (test_comm and test_pipeline do).
TRAIN_BASE = [
    "model=llama3_tiny",
    "trainer.global_batch_size=8",
    "logger=none",
    "metrics.memory_steps=0",
    "metrics.comm_step=null",
]


def compose_cases(cases: dict) -> dict:
    """{name: the typed config of ``TRAIN_BASE`` + overrides} for ``{name: overrides}``:
    composed and converted once in the test process, not again on every rank."""
    from hsdp_runner.config.compose import to_run_config

    return {
        name: to_run_config(compose([*TRAIN_BASE, *overrides])) for name, overrides in cases.items()
    }


def _train_cases(configs):
    """Train each ``{name: composed config}`` case (``compose_cases``) in turn on these ranks
    (tiny model, fp32 unless the overrides say otherwise); return {name: (step records,
    ParallelDims.describe() and ``tensor_peak_gib``)}. The tensor peak
    (``TensorMemoryMeter``, from before the model is built through ``metrics.memory_steps``
    steps, as a job measures it) is measured only where the overrides set
    ``metrics.memory_steps``; it is None elsewhere."""
    import torch.distributed as dist

    from hsdp_runner.runtime.rank_training import rank_trainer
    from hsdp_runner.train.tensor_memory import TensorMemoryMeter

    out = {}
    for name, cfg in configs.items():
        meter = TensorMemoryMeter(torch.device("cpu"), cfg.metrics.memory_steps)
        meter.start()
        trainer, dims = rank_trainer(cfg)
        records = trainer.fit(0, meter.wrap(None, 0))
        peak = meter.stop()
        if peak is not None:
            # Gloo's worker threads free a collective's buffers a little after it completes,
            # at moments that vary by rank and run, which adds up to a few blocks' gradients to
            # a CPU rank's peak; the smallest over the ranks (the same program) is the step's.
            peak = torch.tensor(peak, dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MIN)
            peak = peak.item()
        out[name] = (records, {**dims.describe(), "tensor_peak_gib": peak})
    return out


# Gradient accumulation (``trainer.accum_reduce``), each case against one micro-batch of the same
# global batch in the same layout: {case: (overrides, baseline case)}. FSDP runs a global batch
# of 16 (4 rows a rank), so 1, 2 and 4 micro-batches split it, on 4 blocks of 64 tokens: the
# model's gradients (0.9 MiB fp32) are near a micro-batch's activations, so holding them
# unsharded shows; its tensor peak is measured over the first step. The other layouts run 2
# micro-batches of the fixture's batch of 8.
ACCUM_STEPS = 2
FSDP_16 = [
    "parallel=fsdp",
    "model.n_layers=4",
    "model.seq_len=64",
    "trainer.global_batch_size=16",
    f"trainer.steps={ACCUM_STEPS}",
]
ACCUM_CASES = {
    "fsdp_accum1": ([*FSDP_16, "metrics.memory_steps=1"], None),
    **{
        f"fsdp_accum{n}_{choice}": (
            [
                *FSDP_16,
                "metrics.memory_steps=1",
                f"trainer.grad_accum_steps={n}",
                f"trainer.accum_reduce={choice}",
            ],
            "fsdp_accum1",
        )
        for n, choice in ((2, "every"), (4, "every"), (4, "last"))
    },
    # The 4-micro-batch peaks again, twice each (``_least_peaks``).
    **{
        f"fsdp_accum4_{choice}_{again}": (
            [
                *FSDP_16,
                "metrics.memory_steps=1",
                "trainer.grad_accum_steps=4",
                f"trainer.accum_reduce={choice}",
            ],
            "fsdp_accum1",
        )
        for choice in ("every", "last")
        for again in (2, 3)
    },
    **{
        f"hsdp_accum2_{choice}": (
            ["parallel=hsdp", "trainer.grad_accum_steps=2", f"trainer.accum_reduce={choice}"],
            "hsdp_fp32",
        )
        for choice in ("every", "last")
    },
    # Whole replicas hold whole gradients either way: no sync before the last micro-batch.
    "ddp_accum2": (
        ["parallel=ddp", "parallel.dp_replicate=4", "trainer.grad_accum_steps=2"],
        "ddp_replicate",
    ),
    # TP's partial norm gradients, reduced with each of FSDP's reduce-scatters (and the loss on
    # all-gathered logits: every other TP layout here and in the parity run shards it); HSDP
    # over cp.
    "fsdp_tp_accum2_every": (
        ["parallel=fsdp_tp", "trainer.grad_accum_steps=2", "parallel.loss_parallel=false"],
        "hsdp_fp32",
    ),
    "hsdp_cp_accum2_every": (
        ["parallel=hsdp", "parallel.dp_shard=1", "parallel.cp=2", "trainer.grad_accum_steps=2"],
        "hsdp_cp",
    ),
}


@pytest.fixture(scope="module")
def four_rank_runs():
    """DDP(4) through ``replicate`` and through ``fully_shard`` on a (4, 1) mesh; HSDP(2x2) in
    fp32 and in bf16 for 20 steps, HSDP sharded over cp (2 replicas x cp 2), and the
    accumulation cases (``ACCUM_CASES``); all in one set of four workers."""
    ddp = ["parallel=ddp", "parallel.dp_replicate=4", f"trainer.steps={STEPS}"]
    hsdp = ["parallel=hsdp", f"trainer.steps={BF16_STEPS}"]
    return run_workers(
        _train_cases,
        4,
        compose_cases(
            {
                "ddp_replicate": ddp,
                "ddp_fully_shard": [*ddp, "parallel.ddp_impl=fully_shard"],
                "hsdp_fp32": hsdp,
                "hsdp_bf16": [*hsdp, "precision=bf16"],
                "hsdp_cp": [*hsdp, "parallel.dp_shard=1", "parallel.cp=2"],
                **{
                    name: [f"trainer.steps={ACCUM_STEPS}", *overrides]
                    for name, (overrides, _) in ACCUM_CASES.items()
                },
            }
        ),
    )[0]


@pytest.mark.multiprocess
def test_ddp_replicate_equals_hsdp_with_shard_size_one(four_rank_runs):
    replicate, _ = four_rank_runs["ddp_replicate"]
    hsdp_n1, facts = four_rank_runs["ddp_fully_shard"]
    assert facts["dp_mode"] == "ddp" and facts["mesh_shape"] == [1, 4, 1, 1, 1]
    assert len(hsdp_n1) == STEPS
    assert max(rel_diffs(hsdp_n1, replicate)) <= 1e-6
    assert max(rel_diffs(hsdp_n1, replicate, "grad_norm")) <= 1e-6


@pytest.mark.multiprocess
def test_hsdp_over_context_parallel_ranks_equals_hsdp_over_20_steps(four_rank_runs):
    """2 replicas x (parameters sharded over 2 cp ranks, each holding half of every sequence)
    against 2 x 2 HSDP, which the parity run shows equals a single process."""
    hsdp_cp, facts = four_rank_runs["hsdp_cp"]
    hsdp, _ = four_rank_runs["hsdp_fp32"]
    assert (facts["dp_mode"], facts["layout"], facts["mesh_shape"]) == (
        "hsdp",
        "hsdp_cp",
        [1, 2, 1, 2, 1],
    )
    assert len(hsdp_cp) == BF16_STEPS
    assert max(rel_diffs(hsdp_cp, hsdp)) <= 1e-5
    assert max(rel_diffs(hsdp_cp, hsdp, "grad_norm")) <= 1e-5


@pytest.mark.multiprocess
def test_bf16_stays_within_2e2_of_fp32(four_rank_runs):
    """Over 20 steps; the fp32 run is HSDP, which the parity run shows equals single."""
    bf16, _ = four_rank_runs["hsdp_bf16"]
    fp32, _ = four_rank_runs["hsdp_fp32"]
    assert len(bf16) == BF16_STEPS
    assert max(rel_diffs(bf16, fp32)) <= 2e-2
    assert max(rel_diffs(bf16, fp32)) > 0  # bf16 really ran in bf16


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [name for name, (_, base) in ACCUM_CASES.items() if base])
def test_accumulation_trains_as_one_micro_batch_in_every_layout(four_rank_runs, case):
    """Losses and gradient norms of the first steps within the parity tolerance of the same
    global batch in one micro-batch (fsdp_tp against HSDP, which the parity run shows equal:
    both equal a single process)."""
    records, facts = four_rank_runs[case]
    base, _ = four_rank_runs[ACCUM_CASES[case][1]]
    assert len(records) == ACCUM_STEPS
    assert max(rel_diffs(records, base)) <= 1e-5, case
    assert max(rel_diffs(records, base, "grad_norm")) <= 1e-5, case


@pytest.mark.multiprocess
def test_fsdp_tensor_peak_falls_with_micro_batches_when_every_one_reduces(four_rank_runs):
    """At a fixed global batch, each micro-batch reduce-scattering its gradients
    (``trainer.accum_reduce=every``) keeps only sharded gradients across micro-batches, so the
    peak falls with the activations of a smaller micro-batch (measured: 7.25, 4.03 and 2.59 MiB
    for 1, 2 and 4 micro-batches); with ``last`` every rank holds the model's unsharded
    gradients until the last micro-batch: at 4 micro-batches its peak is higher by nearly
    those gradients less the shard kept anyway (least of three runs: 0.52 to 0.60 MiB of
    0.64)."""
    peak = {
        name: four_rank_runs[name][1]["tensor_peak_gib"]
        for name in ACCUM_CASES
        if name.startswith("fsdp_accum")
    }
    # A reduce-scatter's input (one block's unsharded gradients, 0.19 MiB here) is freed by
    # gloo's worker thread, sometimes after the next allocations: a measured peak may hold 0, 1
    # or 2 of them (0.19 MiB steps, seen from 2.59 to 2.96 MiB for the same 4-micro-batch run).
    # The least of three runs (each already the least over its ranks) is the step's own peak.
    for choice in ("every", "last"):
        name = f"fsdp_accum4_{choice}"
        peak[name] = min([peak[name]] + [peak.pop(f"{name}_{again}") for again in (2, 3)])
    # llama3_tiny at 4 blocks: 4 x 49,280 + 32,832 trainable parameters, fp32, over 4 shards.
    unsharded = 229_952 * 4 / 2**30
    block = 49_280 * 4 / 2**30
    assert peak["fsdp_accum2_every"] < 0.75 * peak["fsdp_accum1"], peak
    assert peak["fsdp_accum4_every"] < 0.85 * peak["fsdp_accum2_every"], peak
    held = peak["fsdp_accum4_last"] - peak["fsdp_accum4_every"]
    # Less one late-freed block, which the least of three runs may still hold.
    assert held >= 0.75 * (unsharded - unsharded / 4) - block, peak


# Expert parallel on the mixture of experts (``parallel.ep``), each case against the parity
# run's single process of moe_tiny (the same overrides: its steps, learning rate and batch): ep
# over all of dp_shard and over part of it, borrowing tp, with HSDP (dp_replicate), borrowing
# cp, under a pipeline, with activation checkpointing, with gradient accumulation and compiled.
# moe_tiny's auxiliary loss and balancing bias are on. The cases that need four ranks (ep over
# part of dp_shard, or beside another dim) train on four in-process workers; those about a
# step's own mechanics (AC, accumulation, compile) on two, ep 2 over dp_shard 2: a tiny
# model's step costs each rank about the same whatever its share of the batch, so four ranks
# would double their CPU and prove nothing more.
EP_BASE = ["model=moe_tiny", "logger=none", *METERS_OFF, f"trainer.steps={STEPS}", *LR]
EP_CASES = {
    "fsdp:parallel.ep=4": ["parallel=fsdp", "parallel.ep=4"],
    "fsdp:parallel.ep=2": ["parallel=fsdp", "parallel.ep=2"],
    # ep = tp, sequence parallel saving its gathered inputs as shards (the dense block's
    # attention and feed-forward, the MoE blocks' attention), the MoE feed-forward recomputed.
    "fsdp_tp:parallel.ep=2:parallel.sp_save_shard=true:parallel.ac=moe": [
        "parallel=fsdp_tp",
        "parallel.ep=2",
        "parallel.sp_save_shard=true",
        "parallel.ac=moe",
    ],
    "hsdp:parallel.ep=2": ["parallel=hsdp", "parallel.ep=2"],
    "cp:parallel.dp_shard=2:parallel.ep=2": ["parallel=cp", "parallel.dp_shard=2", "parallel.ep=2"],
    "pp_fsdp:parallel.ep=2": ["parallel=pp_fsdp", "parallel.ep=2"],
}
EP2 = ["parallel=fsdp", "parallel.dp_shard=2", "parallel.ep=2"]
EP_TWO_RANK_CASES = {
    "ac=full": [*EP2, "parallel.ac=full"],
    "ac=selective": [*EP2, "parallel.ac=selective"],
    # The experts' activation recomputed (the MoE feed-forward's recompute, parallel.ac=moe,
    # is the ep = tp case's).
    "ac=moe_act": [*EP2, "parallel.ac=moe_act"],
    "grad_accum_steps=2": [*EP2, "trainer.grad_accum_steps=2"],
    # Compiled blocks (through aot_eager, as tests/test_compile.py), their experts in the
    # per-expert loop: torch 2.13 compiles the grouped matmul for bfloat16 only
    # (expert_parallel.compile_refusal). The first step compiles (about 8 CPU-s a rank); the
    # later ones meet new token counts as a dynamic dim, compiling nothing more.
    "compile": [
        *EP2,
        "parallel.compile=true",
        "parallel.compile_backend=aot_eager",
        "model.grouped_mm=false",
    ],
}
EVERY_EP_CASE = {**EP_CASES, **EP_TWO_RANK_CASES}


def _ep_cases(configs: dict) -> dict:
    """Train each ``{name: typed config}`` case on these ranks; return {name: (step records,
    ParallelDims.describe(), {MoE block index: its expert_bias after training}, what Dynamo
    compiled: the graphs it had made after each step and the reason of every recompile)}."""
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    from hsdp_runner.distributed.expert_parallel import moe_modules
    from hsdp_runner.runtime.rank_training import rank_trainer

    out = {}
    for name, cfg in configs.items():
        trainer, dims = rank_trainer(cfg)
        clear_compilation_metrics()
        graphs = _GraphCount()
        records = trainer.fit(0, after_step=graphs.after_step)
        compiled = {
            "graphs_after_step": graphs.seen,
            "recompiles": [
                m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason
            ],
        }
        bias = {
            layer: moe.router.expert_bias.clone()
            for part in trainer.parts
            for layer, moe in moe_modules(part).items()
        }
        out[name] = (records, dims.describe(), bias, compiled)
    return out


class _GraphCount:
    """Graphs Dynamo made since this was created, as each step is reported (``after_step``;
    step s is reported once step s + 1's forward and backward ran)."""

    def __init__(self):
        from torch._dynamo.utils import counters

        self.stats, self.seen = counters["stats"], []
        self.start = self.stats["unique_graphs"]

    def after_step(self, step: int) -> None:
        """Note the graphs made until step ``step`` is reported."""
        self.seen.append(self.stats["unique_graphs"] - self.start)


@pytest.fixture(scope="module")
def ep_runs() -> dict:
    """{rank: ``_ep_cases``'s results}: ``EP_CASES`` on four workers, then
    ``EP_TWO_RANK_CASES`` on two (ranks 0 and 1 hold both)."""
    from hsdp_runner.config.compose import to_run_config

    def configs(cases):
        return {name: to_run_config(compose([*EP_BASE, *over])) for name, over in cases.items()}

    runs = run_workers(_ep_cases, 4, configs(EP_CASES))
    for rank, results in run_workers(_ep_cases, 2, configs(EP_TWO_RANK_CASES)).items():
        runs[rank] |= results
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("parity", ["moe_tiny"], indirect=True)
@pytest.mark.parametrize("case", list(EVERY_EP_CASE))
def test_expert_parallel_matches_single_process_within_1e5(parity, ep_runs, case):
    """Losses, grad norms and the step's MoE figures (the experts' load, the auxiliary
    loss) as one process computes them."""
    out, _, _ = parity
    base, _ = read_job(out / "single")
    records, facts = ep_runs[0][case][:2]
    assert facts["ep"] > 1 and facts["layout"].endswith("_ep"), facts
    assert len(records) == STEPS
    assert max(rel_diffs(records, base)) <= 1e-5, case
    assert max(rel_diffs(records, base, "grad_norm")) <= 1e-5, case
    assert max(rel_diffs(records, base, "moe/aux_loss")) <= 1e-5, case
    for key in ("moe/load_max_over_mean", "moe/load_max_over_mean/layer_2"):
        assert [r[key] for r in records] == [r[key] for r in base[: len(records)]], (case, key)


@pytest.mark.multiprocess
def test_compiled_expert_parallel_compiles_nothing_after_the_first_steps(ep_runs):
    """Compiled blocks under ep 2: each step's tokens arrive in new numbers (the all-to-all's
    uneven splits), yet the graphs Dynamo made by the time step 1 is reported (after step 2's
    forward and backward) are all it makes in the run, and no frame is compiled again for a
    size (the exchange runs between the compiled parts and hands the arrived rows over as a
    dynamic dim). The one recompile on each rank is the MoE blocks' forward after the dense
    block's: one code, guarded on ``dense``."""
    compiled_ranks = [rank for rank, result in ep_runs.items() if "compile" in result]
    assert compiled_ranks == [0, 1], compiled_ranks  # the two-rank cases' workers
    for rank in compiled_ranks:
        compiled = ep_runs[rank]["compile"][3]
        graphs = compiled["graphs_after_step"]
        assert len(graphs) == STEPS and graphs[0] > 0, (rank, graphs)
        assert graphs == graphs[:1] * STEPS, (rank, graphs)
        assert len(compiled["recompiles"]) == 1, (rank, compiled["recompiles"])
        assert "self.dense" in compiled["recompiles"][0], (rank, compiled["recompiles"])


@pytest.mark.multiprocess
def test_the_balance_step_moves_every_ranks_bias_alike(ep_runs):
    """Every rank holding a MoE block ends with the same balancing bias, updated (moe_tiny's
    bias_update_speed is on)."""
    for case in EVERY_EP_CASE:
        held: dict[int, list[torch.Tensor]] = {}
        for result in ep_runs.values():
            for layer, bias in result.get(case, (None, None, {}))[2].items():
                held.setdefault(layer, []).append(bias)
        assert sorted(held) == [1, 2], case  # moe_tiny: block 0 dense, blocks 1 and 2 MoE
        for layer, biases in held.items():
            assert biases[0].abs().max() > 0, (case, layer)
            assert all(torch.equal(bias, biases[0]) for bias in biases), (case, layer)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--rtol", "-1"], "--rtol=-1.0 must be a positive number"),
        (["--rtol", "tight"], "--rtol='tight' is not a number"),
        (["--layouts", "fsdp,zero3"], "unknown layout(s) zero3"),
        (["--layouts", "fsdp", "launcher.nproc_per_node=3"], "world size is 3"),
    ],
)
def test_bad_parity_input_is_one_clear_error_before_launch(args, words, tmp_path, capsys):
    # In-process: ``python -m hsdp_runner.parity`` exits with what main() returns.
    code = parity_cli.main([*args, "--out", str(tmp_path / "p"), "model=llama3_tiny"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert words in err
    assert not (tmp_path / "p" / "single" / "logs").exists()


def test_a_layout_the_model_cannot_run_is_reported_as_skipped():
    rows = [
        {"layout": "single", "world_size": 1, "passed": True, "note": ""},
        {
            "layout": "hsdp_cp_tp",
            "world_size": "-",
            "passed": True,
            "skipped": True,
            "note": "(the model cannot run it: parallel.cp=2 with parallel.tp=2 ...)",
        },
    ]
    table = parity_cli.format_table(rows, 1e-5)
    assert (
        "| hsdp_cp_tp | - | - | - | - | - | - | SKIP (the model cannot run it: parallel.cp=2"
        in table
    )


def test_make_parity_runs_every_preset_that_needs_no_more_arguments(monkeypatch, capsys):
    # The README's `make parity` is `python -m hsdp_runner.parity $(PARITY_ARGS)`; --list
    # composes the same default set and launches nothing. On CPU (no GPU to size it) `auto`
    # needs a rank count, so it is left out with a note that says how to run it.
    makefile = (REPO / "Makefile").read_text()
    assert "\t$(PY) -m hsdp_runner.parity $(PARITY_ARGS)\n" in makefile
    make_args = re.search(r"^PARITY_ARGS \?= (.*)$", makefile, re.M).group(1).split()
    monkeypatch.setattr(parity_cli, "usable_gpus", lambda device: 0)
    assert parity_cli.main(["--list", *make_args]) == 0
    out = capsys.readouterr().out.splitlines()
    runs = [line.split()[3] for line in out if line.startswith("parity: would run ")]
    presets = {path.stem for path in (REPO / "conf" / "parallel").glob("*.yaml")}
    assert {name.split(":")[0] for name in runs} == presets - {"auto"}
    assert runs[0] == "single" and {"cp:parallel.cp=4", "cp:parallel.tp=2"} <= set(runs)
    assert [line for line in out if "auto" in line] == [
        "parity: left out auto: its degrees are chosen at launch (-1), which on CPU needs a "
        "rank count; run it with --layouts auto:launcher.nproc_per_node=4"
    ]


def test_compare_checks_the_validation_losses_too():
    base = [{"loss": 2.0, "grad_norm": 1.0}, {"loss": 1.5, "grad_norm": 1.0, "val_loss": 1.8}]
    close = [{**base[0]}, {**base[1], "val_loss": 1.8 * (1 + 1e-7)}]
    far = [{**base[0]}, {**base[1], "val_loss": 1.9}]
    assert parity_cli.compare(base, close, 1e-5)["passed"]
    row = parity_cli.compare(base, far, 1e-5)
    assert not row["passed"] and row["max_rel_val_loss"] == pytest.approx(0.1 / 1.8)
    unvalidated = [base[0], {k: v for k, v in base[1].items() if k != "val_loss"}]
    assert parity_cli.compare(base, unvalidated, 1e-5)["note"] == "validated at other steps"
