"""Pipeline parallel (``parallel.pp``): stages keep the model's names, the degrees and settings
are checked, and every schedule trains the model one process trains.

Parity: one single-process worker trains the baselines, one set of two and one of four
workers train every pp case of that size (each schedule, pp = 2 and 4, pp with FSDP, DDP, TP,
cp), and the shared eight-rank run (conftest ``eight_ranks``) adds pp x FSDP x TP, pp x HSDP and
pp x cp x TP; each case's losses and grad norms must equal its baseline's within the parity
tolerance (1e-5). A float8 case among the four-worker ones has no baseline: it checks what it
communicates. The planner writes exactly the pipeline rows the runner accepts.
"""

import pytest
import torch
from distributed import run_workers
from test_config import compose

from hsdp_runner.config.schema import ParallelConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.models.base import build_meta_model, keep_stage, model_spec, stage_blocks

STEPS = 3
RTOL = 1e-5
LR = ["optim.lr=3e-3", "optim.warmup_steps=1"]
FOUR_LAYERS = "model.n_layers=4"


def test_blocks_split_evenly_with_the_remainder_in_the_middle_never_on_the_last():
    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(6, 4) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    assert stage_blocks(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    with pytest.raises(ConfigError, match="model.n_layers=2 cannot split over 4"):
        stage_blocks(2, 4)
    # The end stages counted as holding one block more (embedding; output layer and loss).
    assert [len(r) for r in stage_blocks(8, 4, 1, 1)] == [1, 3, 3, 1]
    assert [len(r) for r in stage_blocks(126, 8, 1, 1)] == [15] + [16] * 6 + [15]
    assert stage_blocks(4, 2, 2, 0) == [range(0, 1), range(1, 4)]
    # An end stage weighted by all of its share holds no block and runs its ends alone: the
    # layouts Megatron published for DeepSeek-V3 (61 blocks on 32 stages: 1, 2 x 30, 0) and
    # Qwen3-235B (94 on 96: 0, 1 x 94, 0). A middle stage still needs a block.
    assert [len(r) for r in stage_blocks(4, 4, 1, 0)] == [0, 2, 1, 1]
    assert [len(r) for r in stage_blocks(61, 32, 1, 1)] == [1] + [2] * 30 + [0]
    assert [len(r) for r in stage_blocks(94, 96, 1, 1)] == [0] + [1] * 94 + [0]
    with pytest.raises(ConfigError, match="model.n_layers=94 cannot split over 97"):
        stage_blocks(94, 97, 1, 1)
    with pytest.raises(ConfigError, match="pp_first_stage_less_blocks=2 and .* more than its"):
        stage_blocks(4, 4, 2, 0)


@pytest.mark.parametrize("family", ["llama3_tiny", "gpt2_tiny"])
def test_stages_keep_the_unsplit_names_and_together_hold_every_parameter(family):
    cfg = compose([f"model={family}", FOUR_LAYERS]).model
    whole = {n: p.shape for n, p in build_meta_model(cfg).named_parameters()}
    # Even, the end stages weighted (blocks 1, 2, 1), and weighted by their whole share on 4
    # stages (0, 2, 2, 0: the ends alone).
    for n_stages, less in ((3, (0, 0)), (3, (1, 1)), (4, (1, 1))):
        seen = {}
        for stage in range(n_stages):
            with torch.device("meta"):
                part = keep_stage(model_spec(cfg).build(), stage, n_stages, *less)
            names = {n: p.shape for n, p in part.named_parameters()}
            assert not set(names) & set(seen)
            seen.update(names)
        assert seen == whole, less


def _dims(**parallel):
    return ParallelDims.from_config(ParallelConfig(**parallel), None, 8, ranks_per_node=4)


def test_pp_across_nodes_is_fine_but_tp_across_nodes_stays_refused():
    dims = _dims(pp=2, dp_shard=4)
    assert dims.dims_across_nodes() == ["pp"] and dims.layout == "pp_fsdp"
    assert dims.pipeline.microbatches == 4  # the default: 2 x pp
    with pytest.raises(ConfigError, match="parallel.tp=8 spans nodes"):
        _dims(pp=1, dp_shard=1, tp=8)


def test_interleaved_micro_batches_must_come_in_rounds_of_pp():
    interleaved = {"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2}
    with pytest.raises(ConfigError, match="parallel.pp_microbatches=5 does not suit"):
        _dims(pp=2, dp_shard=4, pp_microbatches=5, **interleaved)
    assert _dims(pp=4, dp_shard=2, pp_microbatches=8, **interleaved).pp_stages == 8


def compose_cases(cases: dict) -> dict:
    """{name: typed config} of ``{name: overrides}`` cases (tiny model, fp32, ``STEPS`` steps):
    composed once in the test process, not again on every rank."""
    from hsdp_runner.config.compose import to_run_config

    base = ["trainer.global_batch_size=8", "logger=none", f"trainer.steps={STEPS}"]
    return {
        name: to_run_config(compose([*base, "metrics.comm_step=null", *LR, *overrides]))
        for name, overrides in cases.items()
    }


def _train_cases(configs: dict) -> dict:
    """Train each ``{name: typed config}`` case (``compose_cases``) on these ranks; return
    {name: (step records, measured vs analytic communication or {})}."""
    from hsdp_runner.runtime.rank_training import rank_trainer

    out = {}
    for name, cfg in configs.items():
        trainer, _ = rank_trainer(cfg)
        out[name] = (trainer.fit(), trainer.comm_facts)
    return out


def _case(family, layers, *overrides):
    return [f"model={family}", f"model.n_layers={layers}", *overrides]


# Counted communication: step 2 (the first also sends torch's stage shape metadata).
COMM = "metrics.comm_step=2"
DEFAULT_COMM = "metrics.comm_step=1"
PP = ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.dp_shard=1", "parallel.tp=1"]
INTERLEAVED = ["parallel.pp_stages_per_rank=2"]
INTERLEAVED_1F1B = ["parallel.pp_schedule=interleaved_1f1b", *INTERLEAVED]
ZB = ["parallel.pp_schedule=interleaved_zb", *INTERLEAVED]
NO_RESHARD = "parallel.reshard_after_forward=false"
# name -> (world size, baseline name, overrides)
CASES = {
    "llama_gpipe": (2, "llama2", _case("llama3_tiny", 2, *PP, "parallel.pp_schedule=gpipe")),
    "llama_1f1b": (2, "llama2", _case("llama3_tiny", 2, *PP, COMM)),
    # The first stage weighted as two blocks more: 1 block, then 3 (``stage_blocks``).
    "llama_1f1b_first_less": (
        2,
        "llama4",
        _case("llama3_tiny", 4, *PP, "parallel.pp_first_stage_less_blocks=2", COMM),
    ),
    # Both end stages weighted as a block: the first of the 4 stages runs the embedding alone,
    # the last the norm, output layer and loss alone (blocks 0, 2, 2, 0: Megatron's layout for
    # DeepSeek-V3 and Qwen3-235B), rank 0 holding the embedding and blocks 2-3, rank 1 blocks
    # 0-1 and the output.
    "llama_interleaved_ends_alone": (
        2,
        "llama4",
        _case(
            "llama3_tiny",
            4,
            *PP,
            "parallel.pp_schedule=interleaved_1f1b",
            *INTERLEAVED,
            "parallel.pp_first_stage_less_blocks=1",
            "parallel.pp_last_stage_less_blocks=1",
            COMM,
        ),
    ),
    # Each rank's two stage chunks with their blocks compiled (through Dynamo and AOTAutograd:
    # the runner's compile path; inductor's C++ code generation is left to the GPU check).
    "llama_interleaved_compiled": (
        2,
        "llama4",
        _case(
            "llama3_tiny",
            4,
            *PP,
            "parallel.pp_schedule=interleaved_1f1b",
            *INTERLEAVED,
            "parallel.compile=true",
            "parallel.compile_backend=aot_eager",
        ),
    ),
    "llama_zero_bubble": (
        2,
        "llama4",
        _case("llama3_tiny", 4, *PP, "parallel.pp_schedule=interleaved_zb", *INTERLEAVED),
    ),
    "gpt2_1f1b": (2, "gpt2_2", _case("gpt2_tiny", 2, *PP)),
    # Activation checkpointing wraps each stage chunk's blocks (recomputed, same numbers).
    "llama_1f1b_selective_ac": (2, "llama2", _case("llama3_tiny", 2, *PP, "parallel.ac=selective")),
    "gpt2_interleaved": (
        2,
        "gpt2_4",
        _case("gpt2_tiny", 4, *PP, "parallel.pp_schedule=interleaved_1f1b", *INTERLEAVED),
    ),
    "llama_pp4_1f1b": (4, "llama4", _case("llama3_tiny", 4, *PP, "parallel.pp=4", COMM)),
    "gpt2_pp4_gpipe": (
        4,
        "gpt2_4",
        _case("gpt2_tiny", 4, *PP, "parallel.pp=4", "parallel.pp_schedule=gpipe"),
    ),
    "llama_pp2_fsdp2": (4, "llama2", _case("llama3_tiny", 2, *PP, "parallel.dp_shard=2", COMM)),
    # The zero-bubble schedule's split backward (input, then weight gradients) under FSDP
    # without resharding after forward (with it torch 2.13 trains wrong: refused,
    # ``pipeline_settings.zero_bubble_refusal``).
    "llama_zb_fsdp2": (
        4,
        "llama4",
        _case(
            "llama3_tiny",
            4,
            *PP,
            "parallel.dp_shard=2",
            "parallel.reshard_after_forward=false",
            "parallel.pp_schedule=interleaved_zb",
            *INTERLEAVED,
            COMM,
        ),
    ),
    "gpt2_pp2_tp2": (4, "gpt2_2", _case("gpt2_tiny", 2, *PP, "parallel.tp=2", COMM)),
    # More of what trains inside the stages (the whole matrix, measured once, is in
    # docs/pipeline_parallel.md; what is refused instead, in test_bad_input). Zero-bubble with
    # TP: the stage's loss is a copy, as the schedule detaches it in place.
    "gpt2_zb_tp2": (4, "gpt2_4", _case("gpt2_tiny", 4, *PP, "parallel.tp=2", *ZB)),
    "llama_zb_ddp2": (4, "llama4", _case("llama3_tiny", 4, *PP, "parallel.dp_replicate=2", *ZB)),
    "gpt2_zb_cp2": (4, "gpt2_4", _case("gpt2_tiny", 4, *PP, "parallel.cp=2", *ZB, NO_RESHARD)),
    "gpt2_interleaved_fsdp2": (
        4,
        "gpt2_4",
        _case("gpt2_tiny", 4, *PP, "parallel.dp_shard=2", *INTERLEAVED_1F1B),
    ),
    # The default comm step (1), which a pipeline job moves to step 2.
    "llama_pp2_cp2": (4, "llama2", _case("llama3_tiny", 2, *PP, "parallel.cp=2", DEFAULT_COMM)),
    # Float8 all-gather inside the stages (communication checked, no baseline: one process
    # rounds float8 differently). Each stage chunk gathers its float8 weights at one byte per
    # element and all-reduces their scales' amax once.
    "llama_pp2_fsdp2_float8": (
        4,
        None,
        _case("llama3_tiny", 2, "parallel=pp_fsdp", "precision=float8", COMM),
    ),
}
# The composed cases ride in conftest's shared eight-rank run (``eight_ranks``).
EIGHT_RANK_CASES = {
    "llama_pp2_fsdp2_tp2": _case("llama3_tiny", 2, "parallel=pp_fsdp_tp", COMM),
    "gpt2_pp2_hsdp": _case("gpt2_tiny", 2, "parallel=pp_hsdp", "parallel.pp_schedule=gpipe", COMM),
    # A later Llama stage takes its RoPE positions for the cp rank's whole part of the sequence
    # (its input hidden state is split over tp as well under sequence parallel).
    "llama_zb_cp2_tp2": _case(
        "llama3_tiny", 4, *PP, "parallel.cp=2", "parallel.tp=2", *ZB, NO_RESHARD
    ),
}
EIGHT_RANK_BASELINE = {
    "llama_pp2_fsdp2_tp2": "llama2",
    "gpt2_pp2_hsdp": "gpt2_2",
    "llama_zb_cp2_tp2": "llama4",
}
BASELINES = {
    "llama2": _case("llama3_tiny", 2, "parallel=single"),
    "llama4": _case("llama3_tiny", 4, "parallel=single"),
    "gpt2_2": _case("gpt2_tiny", 2, "parallel=single"),
    "gpt2_4": _case("gpt2_tiny", 4, "parallel=single"),
}


@pytest.fixture(scope="module")
def runs() -> dict:
    """{case or baseline name: rank 0's step records}: one run of workers per world size."""
    out = {
        name: r[0] for name, r in run_workers(_train_cases, 1, compose_cases(BASELINES))[0].items()
    }
    for world in (2, 4):
        cases = {name: c[2] for name, c in CASES.items() if c[0] == world}
        ranks = run_workers(_train_cases, world, compose_cases(cases))
        for name in cases:
            out[name] = ranks[0][name][0]
            out[f"{name}/comm"] = [ranks[r][name][1] for r in sorted(ranks)]
    return out


def _assert_equal(records, base):
    assert len(records) == len(base) == STEPS
    for key in ("loss", "grad_norm"):
        for got, want in zip(records, base):
            assert abs(got[key] - want[key]) <= RTOL * abs(want[key]), (key, got, want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [name for name, c in CASES.items() if c[1]])
def test_pipeline_trains_what_one_process_trains(runs, case):
    _assert_equal(runs[case], runs[CASES[case][1]])
    assert runs[case][-1]["loss"] < runs[case][0]["loss"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(EIGHT_RANK_CASES))
def test_pipeline_composed_with_fsdp_tp_and_hsdp_trains_what_one_process_trains(
    runs, eight_ranks, case
):
    records = eight_ranks[0]["pipeline"][case][0]
    _assert_equal(records, runs[EIGHT_RANK_BASELINE[case]])
    if COMM in EIGHT_RANK_CASES[case]:
        _assert_comm_modelled([eight_ranks[r]["pipeline"][case][1] for r in range(8)])


def _assert_comm_modelled(comm: list[dict]) -> None:
    """Measured communication equals the analytic model on every rank, per (kind, mesh dim),
    calls and bytes: the stage-to-stage sends, the collectives inside the stages, and the
    step's reduction over them (the stats, the grad norm's squares among them)."""
    for rank, facts in enumerate(comm):
        measured, analytic = facts["comm_measured"], facts["comm_analytic"]
        assert "send/pp" in analytic, (rank, analytic)
        assert round(facts["comm_ratio"], 4) == 1.0, (rank, facts)
        assert measured == analytic, (rank, facts)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case", [name for name, c in CASES.items() if {COMM, DEFAULT_COMM} & set(c[2])]
)
def test_stage_to_stage_sends_equal_the_analytic_model_on_every_rank(runs, case):
    comm = runs[f"{case}/comm"]
    assert all(facts["comm_step"] == 2 for facts in comm), case
    _assert_comm_modelled(comm)
    # 1F1B on 2 stages: 4 micro-batches of 2 rows x 32 tokens x 64 fp32 each way.
    if case == "llama_1f1b":
        assert comm[0]["comm_measured"]["send/pp"] == {"calls": 4, "bytes": 4 * 2 * 32 * 64 * 4}


@pytest.mark.multiprocess
def test_float8_stages_gather_one_byte_per_float8_weight(runs):
    """pp 2 x FSDP 2 under float8 all-gather: every (kind, dim) measures exactly the calls
    and bytes the model counts, on every rank. Over the shard group one small all-reduce: the
    scales' amax, one fp32 per float8 weight of the stage (a block's 7 linears); the clip's
    norm rides in the step's stats, over all ranks."""
    comm = runs["llama_pp2_fsdp2_float8/comm"]
    for rank, facts in enumerate(comm):
        measured, analytic = facts["comm_measured"], facts["comm_analytic"]
        assert facts["comm_step"] == 2 and round(facts["comm_ratio"], 4) == 1.0, (rank, facts)
        assert measured == analytic, (rank, facts)
        assert analytic["all_reduce/dp_shard"] == {"calls": 1, "bytes": 7 * 4}, rank


def test_compare_table_shows_the_stages_before_the_stage_layout():
    from pathlib import Path

    from hsdp_runner.core.records import RunSummary
    from hsdp_runner.report.runs import Job, degrees

    def job(summary, config=None):
        return Job(Path("."), 0, [], config or {}, RunSummary(**summary), [])

    ran = {"layout": "pp_fsdp", "mesh_shape": [2, 1, 2, 1, 1], "world_size": 4}
    assert degrees(job(ran)) == ("pp_fsdp", "pp2 1×2×1×1", "4")
    before_pp = {"layout": "fsdp_tp", "mesh_shape": [1, 2, 1, 2], "world_size": 4}
    assert degrees(job(before_pp)) == ("fsdp_tp", "1×2×1×2", "4")
    asked = {"parallel": {"pp": 4, "dp_replicate": 1, "dp_shard": -1, "tp": 1}}
    assert degrees(job({}, asked)) == ("—", "pp4 1×-1×1×1", "—")


def test_bubble_of_each_schedule_and_the_activations_the_first_stage_holds():
    from hsdp_runner.planner.degrees import check_pp_degrees
    from hsdp_runner.planner.pipeline import bubble_fraction, held_microbatches, stage_peak_gib

    assert bubble_fraction("1f1b", 4, 8) == bubble_fraction("gpipe", 4, 8) == 3 / 11
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == 3 / 19
    assert bubble_fraction("interleaved_zb", 4, 8, 2) == pytest.approx(1 / 19)
    assert bubble_fraction("1f1b", 1, 8) == 0.0
    assert held_microbatches("gpipe", 4, 8) == 8 and held_microbatches("1f1b", 4, 8) == 4
    assert held_microbatches("interleaved_1f1b", 4, 8, 2) == (6 + 4 + 1) / 2
    # The first stage holds more micro-batches but runs no output layer or loss; the last runs
    # them with one micro-batch held (all m under GPipe).
    stage = {"saved_activations_gib": 1.0, "peak_gib": 10.0, "peak_without_head_gib": 6.0}
    assert stage_peak_gib(stage, "1f1b", 4, 8) == 10.0  # 6 + 3 held beyond one < 10
    assert stage_peak_gib(stage, "1f1b", 8, 8) == 13.0  # 6 + 7
    assert stage_peak_gib(stage, "gpipe", 4, 8) == 17.0  # 10 + 7
    with pytest.raises(ConfigError, match=r"plan.pp_degrees=\[1, 3\]: 3 is not"):
        check_pp_degrees([1, 3], nodes=4, n_layers=8)


def _faked_pipeline_rows(pp: int, overrides: list[str], planned: list[int]) -> dict:
    """Pipeline rows of ``pp`` stages on ``pp`` nodes of 4 GPUs for ``model=llama3_tiny`` with
    ``overrides`` and 8 micro-batches, each stage plan faked as one FSDP 4 row: 2.5 s busy a
    block + 0.5 s step end; 30 GiB at its measured peak, 28 without the output layer and
    loss, 1 GiB of saved activations a micro-batch. The blocks each stage plan got are
    appended to ``planned``. Returns {schedule: row}."""
    from clusters import fake_cluster

    from hsdp_runner import plan
    from hsdp_runner.planner.pipeline import pipeline_entries

    def plan_stage(stage_cfg, stage_cluster, **kw):
        blocks = stage_cfg.model.n_layers
        planned.append(blocks)
        memory = {"peak_gib": 30.0, "peak_without_head_gib": 28.0}
        memory |= {"saved_activations_gib": 1.0, "forward_held_gib": 1.5}
        fsdp = {"parallel.dp_replicate": 1, "parallel.dp_shard": 4, "parallel.tp": 1}
        row = {"valid": True, "overrides": {**fsdp, "parallel.cp": 1}, "memory": memory}
        row |= {"step_time_s": 2.5 * blocks + 0.5, "step_end_s": 0.5, "compute_s": 2.0 * blocks}
        row |= {"exposed_comm_s": {"dp_shard": 0.5 * blocks}, "mfu": 0.4, "layout": "fsdp"}
        return [row | {"dims_across_nodes": []}]

    base = ["model=llama3_tiny", "trainer.global_batch_size=32", "parallel.pp_microbatches=8"]
    cfg = plan.compose(base + overrides)
    rows = pipeline_entries(cfg, fake_cluster(nodes=pp, gpus_per_node=4), pp, plan_stage)
    return {r["overrides"]["parallel.pp_schedule"]: r for r in rows}


def test_interleaved_schedules_are_priced_at_the_jobs_stages_per_rank():
    """pp 4, 8 micro-batches, 16 blocks (4 a rank, 10 s busy): a job that sets
    ``parallel.pp_stages_per_rank=4`` has its interleaved rows priced at 4, one that leaves it
    at 1 at the default 2. Interleaved 1F1B's bubble is (pp - 1) / (v m) of the busy step
    (Narayanan et al.): 3/16 at v = 2, 3/32 at v = 4: 1.875 and 0.9375 s; the first stage
    holds pp + (pp - 1) / v micro-batches' activations after the warm-up (5.5 and 4.75 of
    1 GiB each on its 28 GiB without the output layer and loss: 32.5 and 31.75 GiB, above
    the last stage's 30); the stage-to-stage sends are v times as many. GPipe and 1F1B run
    one stage per rank either way."""
    planned: list[int] = []
    two = _faked_pipeline_rows(4, ["model.n_layers=16"], planned)
    four = _faked_pipeline_rows(4, ["model.n_layers=16", "parallel.pp_stages_per_rank=4"], planned)
    assert planned == [4, 4]  # 16 blocks: 4 a rank whether cut into 4, 8 or 16 stages
    for rows, v in ((two, 2), (four, 4)):
        row = rows["interleaved_1f1b"]
        assert row["overrides"]["parallel.pp_stages_per_rank"] == v
        assert row["bubble_s"] == pytest.approx(10.0 * 3 / (v * 8))
        assert row["mem_gib"] == pytest.approx(28.0 + (4 + 3 / v - 1) * 1.0)
        assert row["memory"]["pipeline_held_activations_gib"] == pytest.approx(row["mem_gib"] - 30)
        assert rows["1f1b"]["overrides"]["parallel.pp_stages_per_rank"] == 1
        assert rows["1f1b"]["bubble_s"] == pytest.approx(10.0 * 3 / 8)
    assert two["interleaved_1f1b"]["bubble_s"] == pytest.approx(1.875)
    assert four["interleaved_1f1b"]["bubble_s"] == pytest.approx(0.9375)
    assert two["interleaved_1f1b"]["mem_gib"] == pytest.approx(32.5)
    assert four["interleaved_1f1b"]["mem_gib"] == pytest.approx(31.75)
    sends = [rows["interleaved_1f1b"]["exposed_comm_s"]["pp"] for rows in (two, four)]
    assert sends[1] == pytest.approx(2 * sends[0])
    assert four["1f1b"]["step_time_s"] == pytest.approx(two["1f1b"]["step_time_s"])


def test_the_busiest_rank_of_an_interleaved_pipeline_holds_its_stages_blocks():
    """8 blocks on pp 2 with the first stage one block lighter: cut in 2 stages each rank
    holds 4; cut in 4 (2 a rank) the stages hold 1, 3, 2, 2 and rank 1 holds 5. The
    interleaved rows are priced from a stage of 5 blocks, planned apart from the 4-block
    stage GPipe and 1F1B are priced from. End stages weighted by their whole share hold no
    block; a weight above the share raises, naming the keys."""
    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.planner.pipeline import busiest_stage_blocks

    lighter = ["model.n_layers=8", "parallel.pp_first_stage_less_blocks=1"]
    run = to_run_config(compose(lighter))
    assert busiest_stage_blocks(run, 2) == 4 and busiest_stage_blocks(run, 2, 2) == 5
    planned: list[int] = []
    rows = _faked_pipeline_rows(2, lighter, planned)
    assert planned == [4, 5]
    assert rows["1f1b"]["stage_step_time_s"] == 2.5 * 4 + 0.5
    assert rows["interleaved_1f1b"]["stage_step_time_s"] == 2.5 * 5 + 0.5
    # Cut in 4 with both ends weighted: blocks 0, 2, 2, 0, each rank 2.
    ends = ["model.n_layers=4", "parallel.pp_first_stage_less_blocks=1"]
    assert (
        busiest_stage_blocks(
            to_run_config(compose([*ends, "parallel.pp_last_stage_less_blocks=1"])), 2, 2
        )
        == 2
    )
    heavy = ["model.n_layers=4", "parallel.pp_first_stage_less_blocks=2"]
    with pytest.raises(ConfigError, match="weigh an end stage of 4 more than its share"):
        busiest_stage_blocks(to_run_config(compose(heavy)), 2, 2)


@pytest.mark.multiprocess  # the planner measures memory in child processes
def test_plan_prices_pipeline_layouts_from_one_stage(tmp_path, monkeypatch):
    from clusters import fake_cluster

    from hsdp_runner import plan
    from hsdp_runner.planner.layouts import plan_layouts
    from hsdp_runner.planner.pipeline import pipeline_entries

    monkeypatch.setenv("HSDP_RUNNER_CACHE_DIR", str(tmp_path))
    cfg = plan.compose(["model=llama3_tiny", "model.n_layers=4", "cluster.gpus_per_node=2"])
    fsdp = {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}
    rows = pipeline_entries(
        cfg,
        fake_cluster(nodes=2, gpus_per_node=2),
        2,
        lambda c, cl, **kw: plan_layouts(c, cl, {}, fsdp, **kw),
    )
    by_schedule = {r["overrides"]["parallel.pp_schedule"]: r for r in rows}
    # Zero-bubble with FSDP resharding after forward is refused by the runner: not planned.
    assert set(by_schedule) == {"gpipe", "1f1b", "interleaved_1f1b"}
    one = by_schedule["1f1b"]
    assert one["overrides"]["parallel.pp_microbatches"] == 4 and one["bubble_fraction"] == 1 / 5
    assert one["step_time_s"] == pytest.approx(
        one["stage_step_time_s"] + one["bubble_s"] + one["exposed_comm_s"]["pp"]
    )
    assert one["layout"] == "pp_fsdp" and one["dims_across_nodes"][0] == "pp"
    # GPipe holds all 4 micro-batches on every stage, the last one what each one's forward and
    # loss leave (its output layer's and loss's included: more than the blocks'); 1F1B holds 2
    # (= pp) micro-batches' blocks on the first stage alone, which runs no output layer or loss.
    stage = by_schedule["gpipe"]["memory"]
    saved, held, peak = (
        stage["saved_activations_gib"],
        stage["forward_held_gib"],
        stage["peak_gib"],
    )
    assert 0 < saved < held
    assert stage["pipeline_held_activations_gib"] == pytest.approx(3 * held)
    first = stage["peak_without_head_gib"] + saved
    assert one["mem_gib"] == pytest.approx(max(first, peak - 3 * held))
    assert by_schedule["interleaved_1f1b"]["bubble_s"] < one["bubble_s"]
    # On one node of 4 GPUs a stage is 2 of them (asked for: plan.pp_degrees), the same stage
    # layout, its sends over the node's own link.
    inside = pipeline_entries(
        cfg,
        fake_cluster(nodes=1, gpus_per_node=4),
        2,
        lambda c, cl, **kw: plan_layouts(c, cl, {}, fsdp, **kw),
    )
    assert {r["layout"] for r in inside} == {"pp_fsdp"} and len(inside) == len(rows)
    assert all(r["dims_across_nodes"] == [] for r in inside)
    # The stage's 2 blocks stay gathered between micro-batches: fp32, half of each held.
    with torch.device("meta"):
        block = model_spec(compose(["model=llama3_tiny"]).model).build().layers["0"]
    block_bytes = sum(p.numel() for p in block.parameters()) * 4
    assert one["memory"]["pipeline_gathered_blocks_gib"] == pytest.approx(
        2 * block_bytes / 2 / 2**30
    )


def test_a_pipeline_stage_gathers_in_its_first_forward_and_in_each_backward():
    """A stage's schedule keeps its parameters gathered after each micro-batch's backward
    (1 + m gathers of a resharded block a step, the root once), where accumulation gathers
    every unit in each micro-batch's forward: the planner prices a stage the first way, so its
    forward exposes the root's gather once, not m times."""
    from clusters import fake_cluster

    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.distributed.step_passes import fsdp_gathers
    from hsdp_runner.planner.step_time import step_time

    assert fsdp_gathers(4, reshard=True, pipeline_stage=True) == (1, 4)
    assert fsdp_gathers(4, reshard=False, pipeline_stage=True) == (1, 0)
    assert fsdp_gathers(4, reshard=True, pipeline_stage=False) == (4, 4)
    run = to_run_config(
        compose(
            ["model=llama3_tiny", "model.n_layers=2", "parallel=fsdp", "parallel.dp_shard=8"]
            + ["trainer.global_batch_size=32", "trainer.grad_accum_steps=4"]
            + ["trainer.accum_reduce=last"]
        )
    )
    dims = ParallelDims.from_config(run.parallel, run.model, 8)
    stage = step_time(run, dims, fake_cluster(), pipeline_stage=True)
    accumulation = step_time(run, dims, fake_cluster())
    blocks_and_root = 3
    assert stage["comm"]["all_gather/dp_shard"]["calls"] == blocks_and_root + 4 * 2
    assert accumulation["comm"]["all_gather/dp_shard"]["calls"] == 4 * blocks_and_root + 4 * 2
    assert stage["comm"]["reduce_scatter/dp_shard"]["calls"] == blocks_and_root
    assert stage["exposed_comm_s"]["dp_shard"] < accumulation["exposed_comm_s"]["dp_shard"]


def test_parity_skips_the_pipeline_layouts_a_model_is_too_shallow_for():
    from hsdp_runner import parity
    from hsdp_runner.config.compose import to_run_config

    def reason(layout, *overrides):
        return parity.unsupported_reason(to_run_config(parity.compose(layout, list(overrides))))

    assert reason("pp", "model=llama3_tiny") is None
    assert "model.n_layers=2 cannot split over 4" in reason("pp:parallel.pp=4", "model=llama3_tiny")
    assert reason("pp:parallel.pp=4", "model=llama3_tiny", "model.n_layers=4") is None


def test_default_pp_degrees_are_powers_of_two_of_whole_nodes_and_four_blocks_or_more():
    from hsdp_runner.planner.degrees import default_pp_degrees, pp_degrees

    assert default_pp_degrees(nodes=32, n_layers=80) == [1, 2, 4, 8, 16]
    assert default_pp_degrees(nodes=32, n_layers=32) == [1, 2, 4, 8]
    assert default_pp_degrees(nodes=12, n_layers=48) == [1, 2, 4]
    assert default_pp_degrees(nodes=1, n_layers=80) == [1]  # a stage is whole nodes
    assert default_pp_degrees(nodes=4, n_layers=2) == [1]  # tiny models plan no pipeline
    assert pp_degrees([1, 4], nodes=4, n_layers=8) == [1, 4]
    # Asked for on one node, a stage is a share of its GPUs; across nodes, whole nodes.
    assert pp_degrees([2, 4], nodes=1, n_layers=8, gpus_per_node=4) == [2, 4]
    with pytest.raises(ConfigError, match="plan.pp_degrees=\\[2\\]: 2 is not"):
        pp_degrees([2], nodes=3, n_layers=8, gpus_per_node=8)


def test_auto_plans_pipeline_degrees_and_applies_a_pp_choice(tmp_path, monkeypatch):
    """``parallel=auto`` (pp = -1) plans the default pp degrees beside pp = 1 and writes a
    pipeline row's pp, schedule and micro-batches into the job's config, which then validates
    for the job's ranks; an explicit pp is a constraint, and checkpoint settings a pipeline
    cannot honour (the end-of-run HF export without checkpoints) keep pp at 1. Measurements
    are faked (no child process)."""
    from clusters import fake_cluster

    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.planner import auto, mem_phases
    from hsdp_runner.planner import memory as plan_memory

    monkeypatch.setattr(plan_memory, "measure", lambda requests: [{} for _ in requests])
    monkeypatch.setattr(mem_phases, "extrapolate", lambda measured, n_layers: {"0/loss": {}})
    job = [
        "parallel=auto",
        "model=llama3_tiny",
        "model.n_layers=8",
        "trainer.global_batch_size=8",
        "cluster=h100_sxm",
    ]
    cluster = fake_cluster(nodes=2, gpus_per_node=2)
    cfg = compose(job)
    assert auto.planned_pp(to_run_config(cfg), cluster) == [1, 2]
    rows = auto.plan_with_pipelines(cfg, cluster, {}, {})
    piped = [r for r in rows if r["overrides"].get("parallel.pp") == 2]
    flat = [r for r in rows if "parallel.pp" not in r["overrides"]]
    assert piped and flat and [r["rank"] for r in rows if r["valid"]][:3] == [1, 2, 3]
    schedules = {r["overrides"]["parallel.pp_schedule"] for r in piped}
    assert schedules == {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb"}
    best = min(piped, key=lambda r: r["step_time_s"])
    auto.apply_choice(cfg, best["overrides"], tmp_path / "plan.json", cfg.cluster)
    run = to_run_config(cfg)
    assert (
        run.parallel.pp == 2
        and run.parallel.pp_schedule.value == best["overrides"]["parallel.pp_schedule"]
    )
    assert run.parallel.pp_microbatches == 4
    dims = ParallelDims.from_config(run.parallel, run.model, 4, ranks_per_node=2)
    assert dims.pp == 2 and dims.dims_across_nodes()[0] == "pp"
    # A pp = 1 row leaves no -1 behind.
    again = compose(job)
    auto.apply_choice(again, flat[0]["overrides"], tmp_path / "plan.json", again.cluster)
    assert to_run_config(again).parallel.pp == 1
    # An explicit pp is planned alone; one the nodes cannot hold is refused, naming the key.
    assert auto.planned_pp(to_run_config(compose(job + ["parallel.pp=2"])), cluster) == [2]
    with pytest.raises(ConfigError, match="parallel.pp=4 with parallel=auto on 2 node"):
        auto.planned_pp(to_run_config(compose(job + ["parallel.pp=4"])), cluster)
    # The export at the end reads a pipeline's last checkpoint: without checkpoints, no pp.
    exporting = job + ["checkpoint.export_at_end=true"]
    assert auto.planned_pp(to_run_config(compose(exporting)), cluster) == [1]
    saving = to_run_config(compose(exporting + ["checkpoint.enable=true"]))
    assert auto.planned_pp(saving, cluster) == [1, 2]


def test_the_planner_writes_exactly_the_pipeline_rows_the_runner_accepts(tmp_path, monkeypatch):
    """A plan of GPT-2 (8 blocks, bf16) on one node of 4 GPUs over pp 2 and 4, every schedule,
    with settings that decide what the zero-bubble schedule can run as axes (resharding after
    forward, selective AC): each stage layout x schedule is written as a row exactly when its
    job passes the runner's pre-launch checks (``prelaunch.validate``). Measurements are faked
    (no process)."""
    import dataclasses

    from clusters import fake_cluster
    from omegaconf import OmegaConf

    from hsdp_runner import plan
    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.planner import mem_phases
    from hsdp_runner.planner import memory as plan_memory
    from hsdp_runner.planner.layouts import plan_layouts
    from hsdp_runner.planner.pipeline import SCHEDULES, pipeline_entries, stages_per_rank
    from hsdp_runner.runtime import prelaunch

    monkeypatch.setattr(plan_memory, "measure", lambda requests: [{} for _ in requests])
    monkeypatch.setattr(mem_phases, "extrapolate", lambda measured, n_layers: {"0/loss": {}})
    axes = {"parallel.reshard_after_forward": [True, False], "parallel.ac": ["none", "selective"]}
    cfg = plan.compose(["model=gpt2_tiny", "model.n_layers=8", "precision=bf16"])
    cluster = fake_cluster(nodes=1, gpus_per_node=4)
    jobs = {}  # axis values -> the typed job config they make

    def job_of(row: dict):
        """The typed job of a row's overrides: its axis values composed, degrees and pipeline
        settings set on the typed ``parallel``."""
        chosen = tuple((key, row[key]) for key in axes)
        if chosen not in jobs:
            variant = cfg.copy()
            for key, value in chosen:
                OmegaConf.update(variant, key, value, merge=False)
            jobs[chosen] = to_run_config(variant)
        job = jobs[chosen]
        parallel = job.parallel
        for key, value in row.items():
            if key.startswith("parallel.") and key not in axes:
                name = key.split(".")[1]
                kind = type(getattr(parallel, name))
                value = kind(value) if name == "pp_schedule" else value
                parallel = dataclasses.replace(parallel, **{name: value})
        return dataclasses.replace(job, parallel=parallel)

    stages = []  # each pipeline degree's stage rows

    def plan_stage(stage_cfg, stage_cluster, **kw):
        stages.append(plan_layouts(stage_cfg, stage_cluster, axes, **kw))
        return stages[-1]

    written, candidates = set(), set()
    for pp in (2, 4):
        rows = pipeline_entries(cfg, cluster, pp, plan_stage)
        written |= {tuple(sorted(r["overrides"].items())) for r in rows}
        for stage in (s for s in stages[-1] if s["valid"]):
            for schedule in SCHEDULES:
                v = stages_per_rank(to_run_config(cfg), schedule)
                piped = {"parallel.pp": pp, "parallel.pp_schedule": schedule}
                piped |= {"parallel.pp_stages_per_rank": v, "parallel.pp_microbatches": 2 * pp}
                candidates.add(tuple(sorted({**stage["overrides"], **piped}.items())))
    accepted, refused = set(), []
    for row in candidates:
        try:
            prelaunch.validate(job_of(dict(row)), tmp_path / "job")
            accepted.add(row)
        except ConfigError as err:
            refused.append(str(err))
    assert written == accepted
    # Not vacuous: the zero-bubble schedule is planned where it trains and left out where not.
    zb = [dict(k) for k in written if dict(k)["parallel.pp_schedule"] == "interleaved_zb"]
    assert zb and all(r["parallel.ac"] == "none" for r in zb)
    assert any("parallel.ac=selective fails" in r for r in refused)
    assert any("precision.param_dtype=bfloat16 != precision.master_dtype" in r for r in refused)
    assert any("parallel.reshard_after_forward=true computes wrong" in r for r in refused)


def test_a_stage_keeps_each_weight_gathered_over_the_group_it_is_sharded_over():
    """Between micro-batches a stage's blocks stay gathered, each weight over its own FSDP
    group: with ep over every rank of the replica (efsdp 1) a rank's routed experts are whole
    already, so only the rest of the blocks (attention, norms, router, shared experts: over
    the 4 ranks) is gathered on top of the shards."""
    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.planner.pipeline import gathered_blocks_gib

    run = to_run_config(compose(["model=moe_tiny", "precision=bf16"]))
    with torch.device("meta"):
        model = model_spec(run.model).build()
    blocks = {n: p.numel() for n, p in model.named_parameters() if n.startswith("layers.")}
    experts = sum(n for name, n in blocks.items() if ".moe.experts." in name)
    rest = sum(blocks.values()) - experts
    assert experts > 0 and rest > 0
    for ep, efsdp in ((4, 1), (2, 2)):
        dims = ParallelDims(
            dp_replicate=1, dp_shard=4, tp=1, ep=ep, world_size=4, ranks_per_node=4, moe=True
        )
        # bf16: 2 bytes; a weight sharded over g ranks has (1 - 1/g) of it gathered on top.
        expected = (rest * 3 / 4 + experts / ep * (1 - 1 / efsdp)) * 2 / 2**30
        assert gathered_blocks_gib(run, dims) == pytest.approx(expected)


def test_warm_up_is_counted_per_rank_from_the_schedule_order():
    """Qwen3-235B's published pipeline (94 blocks over pp 8 x v 4 virtual stages of 3, the end
    stages one block lighter; 512 micro-batches): at their peaks rank 0 holds 102 block-micro-
    batches and rank 1 the most, 111, not rank 0's in-flight count (9.75 chunks) times the
    busiest rank's 12 blocks (117). 1F1B on the same uneven cut: rank 0 holds 8 micro-batches
    of 11 blocks (88). On even splits the count is Megatron's warm-up, as before."""
    from hsdp_runner.models.base import stage_blocks
    from hsdp_runner.planner.pipeline import held_microbatches
    from hsdp_runner.planner.pipeline_schedule import held_blocks

    sizes = tuple(len(s) for s in stage_blocks(94, 32, 1, 1))
    assert held_blocks("interleaved_1f1b", 8, 512, 4, sizes) == (102, 111, 105, 99, 93, 87, 81, 75)
    assert held_microbatches("interleaved_1f1b", 8, 512, 4, sizes) == 111 / 12
    one = tuple(len(s) for s in stage_blocks(94, 8, 1, 1))
    assert held_blocks("1f1b", 8, 512, 1, one) == (88, 84, 72, 60, 48, 36, 24, 11)
    assert held_microbatches("1f1b", 8, 512, 1, one) == 88 / 12
    # Even splits: the old figures.
    assert held_microbatches("interleaved_1f1b", 4, 8, 2, (2,) * 8) == (6 + 4 + 1) / 2
    assert held_microbatches("interleaved_1f1b", 8, 512, 4) == (14 + 24 + 1) / 4
    assert held_microbatches("1f1b", 4, 8, 1, (3,) * 4) == 4
    assert held_microbatches("gpipe", 4, 8, 1, (3,) * 4) == 8


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "interleaved_zb"])
@pytest.mark.parametrize("pp, m, v", [(4, 8, 2), (4, 6, 3), (8, 16, 4), (4, 3, 2), (2, 4, 2)])
def test_rank_order_is_torchs_schedule_order(schedule, pp, m, v):
    """The planner's orders against torch's own (``_calculate_single_rank_operations``, run
    on a schedule object given only the attributes it reads)."""
    from torch.distributed.pipelining import schedules

    from hsdp_runner.planner.pipeline_schedule import FORWARD, INPUT_BACKWARD, RELEASE, rank_order

    cls = {
        "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
        "interleaved_zb": schedules.ScheduleInterleavedZeroBubble,
    }[schedule]
    kind = schedules._ComputationType
    step = {kind.FORWARD: FORWARD, kind.FULL_BACKWARD: RELEASE}
    step |= {kind.BACKWARD_INPUT: INPUT_BACKWARD, kind.BACKWARD_WEIGHT: RELEASE}
    torch_schedule = object.__new__(cls)
    torch_schedule.pp_group_size, torch_schedule.n_local_stages = pp, v
    torch_schedule._n_microbatches = m
    torch_schedule.number_of_rounds = max(1, m // pp)
    torch_schedule.microbatches_per_round = m // torch_schedule.number_of_rounds
    for rank in range(pp):
        actions = torch_schedule._calculate_single_rank_operations(rank)
        theirs = [(a.stage_index // pp, step[a.computation_type]) for a in actions if a]
        assert rank_order(schedule, pp, m, v, rank) == theirs, rank
