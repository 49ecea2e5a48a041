"""The planner: every layout listed and ranked, memory from the fake-PG tracker equal to exact
arithmetic, step-time terms, the planned sweep, predicted vs measured, calibration, bad input."""

import json
from pathlib import Path

import pytest
import yaml
from clusters import fake_cluster, quiet_load
from omegaconf import OmegaConf

from hsdp_runner import plan
from hsdp_runner.config.compose import CONF_DIR, to_run_config
from hsdp_runner.config.schema import ClusterConfig
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.distributed.param_sizes import view_sizes
from hsdp_runner.planner import calibrate as plan_calibrate
from hsdp_runner.planner import layout_memory
from hsdp_runner.planner import memory as plan_memory
from hsdp_runner.planner.cluster import Cluster
from hsdp_runner.planner.step_time import step_time
from hsdp_runner.report import prediction

# One block: the fake measurement then needs one depth per layout group (fast); the per-block
# extrapolation has its own test.
TINY = [
    "model=llama3_tiny",
    "model.n_layers=1",
    "trainer.global_batch_size=8",
    "cluster.gpus_per_node=4",
]


@pytest.fixture(scope="module")
def planned(tmp_path_factory, monkeypatch_module):
    """One plan of the tiny model on 4 H100s with an AC axis and a 3-layout sweep."""
    out = tmp_path_factory.mktemp("plan")
    code = plan.main(
        TINY
        + [
            f"plan.out_dir={out}",
            "plan.axes.parallel.ac=none,full",
            f"plan.write_sweep={out}/planned.yaml",
            "plan.top_k=3",
        ]
    )
    assert code == 0
    return out, json.loads((out / "plan.json").read_text())


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("HSDP_RUNNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield mp
    mp.undo()


def _dims(rep: int, shard: int, tp: int, world: int, node: int, cp: int = 1) -> ParallelDims:
    return ParallelDims(
        dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, world_size=world, ranks_per_node=node
    )


def test_plan_lists_every_layout_and_axis_value_ranked_with_invalid_reasons(planned):
    out, data = planned
    assert data["version"] == 1 and data["world_size"] == 4 and data["model"] == "llama3_tiny"
    shapes = {
        (
            e["overrides"]["parallel.dp_replicate"],
            e["overrides"]["parallel.dp_shard"],
            e["overrides"]["parallel.cp"],
            e["overrides"]["parallel.tp"],
            e["overrides"]["parallel.ac"],
        )
        for e in data["layouts"]
    }
    # 10 degree tuples of 4 (cp 1, 2 and 4 all split llama3_tiny's 32 tokens) x 2 AC modes
    assert len(shapes) == len(data["layouts"]) == 10 * 2
    valid = [e for e in data["layouts"] if e["valid"]]
    assert [e["rank"] for e in valid] == list(range(1, len(valid) + 1))
    times = [e["step_time_s"] for e in valid if e["fits"]]
    assert times == sorted(times)
    for entry in data["layouts"]:
        if entry["valid"]:
            assert entry["mem_gib"] > 0 and entry["tps_per_device"] > 0 and entry["dominant"]
            # The phase the peak falls in is named, and is the largest of the phases listed.
            memory = entry["memory"]
            assert memory["phase_gib"][memory["peak_phase"]] == max(memory["phase_gib"].values())
        else:  # llama3_tiny has 2 kv heads: tp=4 does not divide them
            assert entry["overrides"]["parallel.tp"] == 4 and "n_kv_heads" in entry["reason"]
            assert entry["step_time_s"] is None and entry["rank"] is None
    md = (out / "plan.md").read_text()
    assert "invalid: parallel.tp=4" in md
    assert "| memory peak |" in md and "loss backward" in json.dumps(data)
    # Per term of the best layout: the group's shape on the nodes, the link and the algorithm.
    assert "## Links of rank 1" in md and "| link | algorithm |" in md and "| ring |" in md
    assert "tree all-reduce" in md and "is not modelled" in md


def test_full_ac_predicts_less_memory_and_more_compute(planned):
    _, data = planned
    by = {
        (
            tuple(
                e["overrides"][k]
                for k in (
                    "parallel.dp_replicate",
                    "parallel.dp_shard",
                    "parallel.cp",
                    "parallel.tp",
                )
            ),
            e["overrides"]["parallel.ac"],
        ): e
        for e in data["layouts"]
        if e["valid"]
    }
    none, full = by[((1, 4, 1, 1), "none")], by[((1, 4, 1, 1), "full")]
    assert full["memory"]["activations_gib"] < none["memory"]["activations_gib"]
    assert full["compute_s"] > none["compute_s"]


def test_tracked_sharded_params_equal_exact_arithmetic(planned):
    """The fake-PG tracker's sharded parameters of a layout equal elements x dtype / the ranks
    FSDP shards over, dp_shard x cp (the measurements the planned fixture made, read back from
    its cache)."""
    cfg = plan.compose(TINY)
    plain = OmegaConf.to_container(cfg, resolve=True)
    for shape, micro in (
        ((4, 1, 1, 1), 2),
        ((2, 2, 1, 1), 2),
        ((1, 2, 1, 2), 4),
        ((2, 1, 1, 2), 4),
        ((2, 1, 2, 1), 4),
        ((1, 1, 4, 1), 8),
    ):
        req = plan_memory.request(
            plain["model"],
            plain["parallel"],
            plain["precision"],
            [],
            shape,
            micro,
            1,
            4,
            4,
            1,
            accum_reduce="every",
        )
        measured = plan_memory.measure([req])[0]["peak"]
        dims = _dims(*shape[:2], shape[3], 4, 4, cp=shape[2])
        exact = layout_memory.state_bytes(view_sizes(cfg.model, dims), dims, 4)
        assert measured["sharded_param"] == exact["params"], shape
    # TP alone in fp32 has no data-parallel wrapper: measured by the plain MemTracker.
    req = plan_memory.request(
        plain["model"],
        plain["parallel"],
        plain["precision"],
        [],
        (1, 1, 1, 2),
        8,
        1,
        2,
        2,
        1,
        accum_reduce="every",
    )
    measured = plan_memory.measure([req])[0]["peak"]
    dims = _dims(1, 1, 2, 2, 2)
    exact = layout_memory.state_bytes(view_sizes(cfg.model, dims), dims, 4)
    assert measured["sharded_param"] == exact["params"] and measured["act"] > 0


def test_tracked_expert_params_are_sharded_over_ep_and_the_experts_fsdp_dim():
    """A model with experts: the fake build's sharded parameters equal the exact arithmetic, the
    experts over ep x efsdp and the rest over dp_shard x cp (moe_tiny, one dense and two MoE
    blocks, 4 ranks): FSDP 4 with ep 1, 2, 4 and FSDP 2 x TP 2 with ep 2 (experts over
    dp_shard x tp)."""
    from test_plan_memory import one_request

    cfg = plan.compose(["model=moe_tiny"])
    cases = [((1, 4, 1, 1), ep) for ep in (1, 2, 4)] + [((1, 2, 1, 2), 2)]
    requests = [
        one_request(["model=moe_tiny"], shape, 2, 4, (1, 2), experts={"ep": ep, "imbalance": 1.0})
        for shape, ep in cases
    ]
    for (shape, ep), got in zip(cases, plan_memory.measure(requests, use_disk_cache=False)):
        degrees = dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), shape))
        dims = ParallelDims(**degrees, world_size=4, ranks_per_node=4, ep=ep, moe=True)
        exact = layout_memory.state_bytes(view_sizes(to_run_config(cfg).model, dims), dims, 4)
        assert got["peak"]["sharded_param"] == exact["params"], (shape, ep)
        assert got["peak"]["act"] > 0


def _one_rank(*cases: tuple[str, int, int]) -> list[dict]:
    """The tracker's peak categories of llama3_tiny (fp32) on one fake rank with no wrapper,
    per (ac, blocks, micro-batch) case, measured in one child process."""
    from test_plan_memory import one_request

    requests = [
        one_request(
            ["model=llama3_tiny", "model.seq_len=256", "parallel=single", f"parallel.ac={ac}"],
            rows=micro,
            n_layers=n_layers,
        )
        for ac, n_layers, micro in cases
    ]
    return [m["peak"] for m in plan_memory.measure(requests, use_disk_cache=False)]


def test_selective_ac_block_keeps_every_other_matmul_output_and_loss_temporaries_are_fp32():
    """One more block under selective AC adds exactly what the policy saves, per token: the
    block's input, the 1st/3rd/5th/7th matmul outputs (wq, wv, w1, w2; wk, wo, w3 are
    recomputed), the attention output and its fp32 log-sum-exp per head. Without AC the peak
    is the loss backward, before any gradient exists: two fp32 vocab-sized temporaries (the
    gradient of the log-probabilities, then of the logits)."""
    one, two, none = _one_rank(("selective", 1, 4), ("selective", 2, 4), ("none", 1, 4))
    tokens, dim, kv, ffn, heads, vocab = 4 * 256, 64, 2 * 16, 192, 4, 256
    per_token = 4 * (dim + dim + kv + dim + ffn + dim) + 4 * heads
    assert two["act"] - one["act"] == tokens * per_token
    assert none["temp"] == 2 * tokens * vocab * 4 and none["sharded_grad"] == 0


def _cluster(**kw) -> Cluster:
    return fake_cluster(**kw)


@pytest.mark.parametrize("precision, element_bytes", [("fp32", 4), ("bf16_pure", 2)])
def test_step_end_streams_each_ranks_trainable_shard_ten_times_at_memory_bandwidth(
    precision, element_bytes
):
    """Clipping (read; read + write) and fused AdamW (4 reads, 3 writes) over the rank's
    trainable shard of the master dtype: whole replicas pay for every element of their TP
    part, FSDP for 1/dp_shard of it (padding included), frozen parameters for nothing."""
    cfg = plan.compose(["model=llama3_debug", f"precision={precision}"])
    cluster = _cluster(memory_gbps=100.0)
    for dims in (_dims(8, 1, 1, 8, 8), _dims(1, 8, 1, 8, 8), _dims(2, 2, 2, 8, 8)):
        units = view_sizes(cfg.model, dims)
        trainable = sum(u[1] for u in units.values()) // dims.dp_shard
        expected = trainable * element_bytes * 10 / 100e9
        assert step_time(cfg, dims, cluster)["step_end_s"] == pytest.approx(expected, rel=1e-12)
    ddp = step_time(cfg, _dims(8, 1, 1, 8, 8), cluster)["step_end_s"]
    fsdp = step_time(cfg, _dims(1, 8, 1, 8, 8), cluster)["step_end_s"]
    assert fsdp == pytest.approx(ddp / 8, rel=1e-3)
    frozen = plan.compose(
        ["model=llama3_debug", f"precision={precision}", "trainer.freeze=[tok_embeddings.*]"]
    )
    assert step_time(frozen, _dims(8, 1, 1, 8, 8), cluster)["step_end_s"] < ddp


def test_step_time_exposes_tp_and_spills_fsdp_across_slow_nodes():
    cfg = plan.compose(
        ["model=llama3_8b", "precision=bf16", "trainer.global_batch_size=8", "model.seq_len=2048"]
    )
    fast = _cluster(nodes=1, gpus_per_node=8)
    fsdp = step_time(cfg, _dims(1, 8, 1, 8, 8), fast)
    assert fsdp["dominant"] == "compute"
    hidden = fsdp["exposed_comm_s"]["dp_shard"]
    slow = step_time(cfg, _dims(1, 8, 1, 8, 4), _cluster(nic_gbit=0.08))
    assert slow["dominant"] == "comm:dp_shard" and slow["exposed_comm_s"]["dp_shard"] > 10 * hidden
    no_overlap = step_time(cfg, _dims(1, 8, 1, 8, 4), _cluster(overlap=0.0))
    assert no_overlap["step_time_s"] == pytest.approx(
        no_overlap["compute_s"] + no_overlap["step_end_s"] + no_overlap["comm_total_s"]
    )
    tp = step_time(cfg, _dims(2, 1, 4, 8, 8), fast)
    assert tp["exposed_comm_s"]["tp"] == pytest.approx(
        sum(v for k, v in _times(cfg, _dims(2, 1, 4, 8, 8), fast).items() if k.endswith("/tp"))
    )


def _times(cfg, dims, cluster):
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.planner.step_time import comm_times

    return comm_times(
        analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer), dims, cluster
    )


def test_planned_sweep_composes_to_the_top_layouts_with_plan_source(planned):
    out, data = planned
    from hydra import compose, initialize_config_dir

    sweep = yaml.safe_load((out / "planned.yaml").read_text())
    names = sweep["hydra"]["sweeper"]["params"]["planned_layouts"].split(",")
    top = [e for e in data["layouts"] if e["valid"] and e["fits"]][:3]
    assert len(names) == 3
    # As `python -m hsdp_runner --config-dir <dir> --config-name planned` finds it.
    with initialize_config_dir(config_dir=str(out), version_base="1.3"):
        for name, entry in zip(names, top):
            cfg = compose(
                config_name="planned",
                overrides=[f"hydra.searchpath=[file://{CONF_DIR}]", f"planned_layouts={name}"],
            )
            assert cfg.plan.source == str((out / "plan.json").resolve())
            assert cfg.model.name == "llama3_tiny" and cfg.launcher.nproc_per_node == 4
            for key, value in entry["overrides"].items():
                assert OmegaConf.select(cfg, key) == value


def _job(
    sweep: Path, num: int, overrides: dict, step_s: float, source: str, mem: dict | None = None
) -> Path:
    job = sweep / f"{num}_job"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"planned_layouts=r{num}"]))
    config = {"plan": {"source": source}}
    for key, value in overrides.items():
        OmegaConf.update(node := OmegaConf.create(config), key, value)
        config = OmegaConf.to_container(node)
    (job / "config_resolved.yaml").write_text(yaml.safe_dump(config))
    summary = {
        "status": "completed",
        "median_step_time_s": step_s,
        "median_tps_global": 1 / step_s,
        "min_tps_global": 0.9 / step_s,
        "max_tps_global": 1.1 / step_s,
        "mem_peak_gib": 1.0,
    }
    summary.update(mem or {})  # the memory fields per rank
    (job / "summary.json").write_text(json.dumps(summary))
    return job


def test_compare_pairs_jobs_with_their_layouts_and_scores_the_ranking(planned, tmp_path):
    out, data = planned
    from hsdp_runner import compare

    source = str((out / "plan.json").resolve())
    top = [e for e in data["layouts"] if e["valid"] and e["fits"]][:3]
    # Job 0 (from before the tensor meter) recorded peaks and baselines: its busiest rank
    # added predicted / 1.3. Job 1's largest tensor peak is predicted / 1.1 (its peak RSS
    # minus baseline, much larger, is not what the planner predicts). Job 2 recorded nothing.
    mems = [
        {
            "mem_peak_gib_per_rank": [0.5 + top[0]["mem_gib"] / 1.3, 0.6],
            "mem_baseline_gib_per_rank": [0.5, 0.5],
        },
        {
            "mem_peak_gib_per_rank": [5.0, 5.0],
            "mem_baseline_gib_per_rank": [0.3, 0.2],
            "mem_tensor_peak_gib_per_rank": [top[1]["mem_gib"] / 1.2, top[1]["mem_gib"] / 1.1],
        },
        None,
    ]
    jobs = [
        _job(tmp_path, i, e["overrides"], e["step_time_s"] * (1.1 + 0.1 * i), source, mems[i])
        for i, e in enumerate(top)
    ]
    found = prediction.predictions_for(jobs)
    assert [found[j]["rank"] for j in jobs] == [e["rank"] for e in top]
    assert compare.main([str(tmp_path)]) == 0
    text = (tmp_path / "compare.md").read_text()
    assert "## Predicted vs measured" in text and "Spearman's rank correlation" in text
    assert "1.00" in text and "-9%" in text and "measured best in the predicted top 2: True" in text
    # Errors of +30% and +10%: a median of 20%, off any rounding boundary.
    assert "+30%" in text and "+10%" in text and "| n/a | n/a |" in text
    assert "median |error| 20%, largest 30%; 1 of 2 jobs within 15%" in text


def test_spearman_handles_ties_and_degenerate_input():
    assert prediction.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert prediction.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert prediction.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)
    assert prediction.spearman([1], [1]) is None and prediction.spearman([1, 1], [1, 2]) is None


def test_calibrate_recovers_efficiency_and_link_scale(planned, tmp_path):
    out, data = planned
    source = str((out / "plan.json").resolve())
    valid = [e for e in data["layouts"] if e["valid"]]
    for i, e in enumerate(valid):  # a machine 2x slower at compute, 3x at links, 5x per call
        compute, bandwidth, latency = plan_calibrate._terms(e)
        measured = 2 * compute + 3 * bandwidth + 5 * latency + e["step_end_s"]
        _job(tmp_path, i, e["overrides"], measured, source)
    report = plan_calibrate.calibrate(tmp_path)
    fitted = yaml.safe_load((tmp_path / "cluster_calibrated.yaml").read_text())
    assert fitted["compute_efficiency"] == pytest.approx(data["cluster"]["compute_efficiency"] / 2)
    assert fitted["link_scale"] == pytest.approx(1 / 3, rel=1e-4)
    assert fitted["latency_scale"] == pytest.approx(5, rel=1e-4)
    assert "cluster.calibration=" in report
    plan_calibrate.calibrate(tmp_path)  # a second fit never overwrites the first
    assert (tmp_path / "cluster_calibrated_1.yaml").exists()
    code = plan.main(
        TINY
        + [
            f"plan.out_dir={tmp_path / 'again'}",
            f"cluster.calibration={tmp_path / 'cluster_calibrated.yaml'}",
        ]
    )
    again = json.loads((tmp_path / "again" / "plan.json").read_text())
    assert code == 0 and again["cluster"]["link_scale"] == pytest.approx(1 / 3, rel=1e-4)


def test_a_model_whose_training_state_fits_nowhere_is_refused_before_any_measurement(
    monkeypatch, capsys
):
    """Dense or with experts: parameters, gradients and AdamW moments spread over every rank
    already exceed a device, so no layout is measured (70B on one node of H100s; Qwen3-235B
    on one; 235B passes the bound on 8 nodes and is measured from there on)."""

    def measured(requests, use_disk_cache=True):
        raise AssertionError("a layout was measured")

    monkeypatch.setattr(plan_memory, "measure", measured)
    for model, ranks in (("llama3_70b", 14), ("qwen3_235b_a22b", 46)):
        assert plan.main([f"model={model}", "cluster=h100_sxm"]) == 2
        err = capsys.readouterr().err
        assert f"model {model} fits on no layout of 8 x 79.2 GiB devices" in err
        assert f"use at least {ranks} ranks" in err and err.count("\n") == 1
    with pytest.raises(AssertionError, match="a layout was measured"):
        plan.main(["model=qwen3_235b_a22b", "cluster=h100_sxm", "cluster.nodes=8"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["cluster=nope"], "Could not find 'cluster/nope'"),
        (["cluster.nodez=2"], "cluster.nodez"),
        (["plan.axes.parallel.acc=none,full"], "parallel.acc is not a key"),
        (["plan.layers_measured=[2]"], "plan.layers_measured=[2] needs two"),
        (
            [
                "trainer.global_batch_size=3",
                "cluster.gpus_per_node=2",
                "model=llama3_tiny",
                "model.n_heads=3",
                "model.n_kv_heads=1",
                "model.dim=48",
                "model.seq_len=30",
            ],
            "no layout of 2 ranks",
        ),  # 30 tokens: no cp splits them into 2 x cp chunks either
        (  # the key that rules out most layouts comes first, with its count
            ["cluster=h100_sxm", "cluster.nodes=16", "trainer.global_batch_size=8"],
            "valid for this config: trainer.global_batch_size=8 is not divisible",
        ),
        (["plan.ep_degrees=[1,2]"], "plan.ep_degrees=[1, 2]: the model has no routed experts"),
        (["model=moe_tiny", "plan.ep_degrees=[0]"], "plan.ep_degrees=[0]: each expert-parallel"),
        (["model=moe_tiny", "plan.expert_imbalance=0.5"], "plan.expert_imbalance=0.5 must be >= 1"),
        (  # what a job refuses is not planned
            [
                "model=moe_tiny",
                "precision=float8",
                "precision.float8_experts=true",
                "model.grouped_mm=false",
            ],
            "precision.float8=tensorwise with a model with experts (model.n_experts=8) and "
            "model.grouped_mm=false",
        ),
        (  # what is measured slower than bf16 and not modelled is not priced
            ["model=moe_tiny", "precision=float8", "precision.float8_experts=true"],
            "precision.float8_experts=true is not priced",
        ),
        (
            ["model=moe_tiny", "precision=bf16", "precision.float8_experts=true"],
            "precision.float8_experts=true with precision.float8=none",
        ),
        (
            ["model=moe_tiny", "parallel.compile=true"],
            "torch 2.13 compiles the experts' grouped matmul for bfloat16 only",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(args, message, capsys):
    assert plan.main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["plan.axes.parallel.ac=none,sometimes"],
            (
                "plan.axes.parallel.ac: parallel.ac='sometimes' "
                "is not one of none, full, selective, moe, moe_act; set parallel.ac to one of them"
            ),
        ),
        (
            ["plan.axes.parallel.ddp_impl=replicate,fsdp"],
            (
                "plan.axes.parallel.ddp_impl: "
                "parallel.ddp_impl='fsdp' is not one of replicate, fully_shard"
            ),
        ),
        (
            ["plan.axes.trainer.steps=4,abc"],
            (
                "plan.axes.trainer.steps=abc: Error merging override "
                "trainer.steps=abc: Value 'abc' of type 'str' could not be converted to Integer"
            ),
        ),
        (
            ["plan.axes.trainer.steps=0"],
            ("plan.axes.trainer.steps=0: trainer.steps=0 must be a positive integer"),
        ),
        (
            ["parallel.ac=sometimes"],
            "parallel.ac='sometimes' is not one of none, full, selective, moe, moe_act",
        ),
    ],
)
def test_an_axis_value_is_checked_like_the_same_override_in_one_line(args, message, capsys):
    """Each ``plan.axes.<key>`` value gets the command line's checks (the choice's allowed
    values, Hydra's typing, the cross-field rules): exit 2 and one line naming the axis."""
    assert plan.main(["model=llama3_tiny"] + args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize("target", ["plan.write_sweep", "plan.out_dir"])
def test_a_plan_over_earlier_files_exits_2_before_measuring_and_keeps_them(
    planned, target, tmp_path, monkeypatch, capsys
):
    """Rerunning the README's plan command: the sweep it wrote (or a plan dir) exists. One
    line naming the key and the fix, before minutes of planning, and the files stay."""
    out, _ = planned
    kept = {p: p.read_bytes() for p in (out / "planned.yaml", out / "plan.json")}
    monkeypatch.setattr(plan_memory, "measure", lambda *a, **k: pytest.fail("measured"))
    args = {
        "plan.write_sweep": [
            f"plan.out_dir={tmp_path / 'new'}",
            f"plan.write_sweep={out}/planned.yaml",
        ],
        "plan.out_dir": [f"plan.out_dir={out}"],
    }[target]
    assert plan.main(TINY + args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{target}=" in err and f"choose another {target}" in err
    assert {p: p.read_bytes() for p in kept} == kept
    assert not (tmp_path / "new").exists()


def test_model_that_fits_nowhere_is_listed_and_exits_2(monkeypatch_module, tmp_path, capsys):
    from hsdp_runner.planner.state_bound import state_lower_bound_gib

    # Above what the training state alone needs (refused before measuring), below any peak.
    bound = state_lower_bound_gib(to_run_config(plan.compose(TINY)), 4, 0.0)
    memory = [f"cluster.device_memory_gib={bound * 1.01}", "cluster.memory_reserve_gib=0"]
    code = plan.main(TINY + [f"plan.out_dir={tmp_path}", *memory])
    captured = capsys.readouterr()
    assert code == 2 and "fits on no layout" in captured.err
    assert "does not fit" in captured.out
    assert all(
        not e["fits"]
        for e in json.loads((tmp_path / "plan.json").read_text())["layouts"]
        if e["valid"]
    )


@pytest.mark.parametrize("model", ["llama3_tiny", "gpt2_tiny"])
def test_selective_ac_recomputes_the_flops_the_planner_counts(model):
    """Forward + backward of a real model, counted by torch's FlopCounterMode: selective AC
    adds exactly the model's ``selective_recompute_flops_per_token`` (the planner's term)."""
    import torch
    from test_config import compose
    from torch.utils.flop_counter import FlopCounterMode

    from hsdp_runner.distributed.parallelize import apply_ac
    from hsdp_runner.models.base import model_spec

    spec = model_spec(compose([f"model={model}"]).model)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len))

    def train_flops(ac: str) -> int:
        model_ = spec.build()
        model_.init_weights(0)
        apply_ac(model_, ac)
        with FlopCounterMode(display=False) as counter:
            model_(tokens).float().sum().backward()
        return counter.get_total_flops()

    extra = train_flops("selective") - train_flops("none")
    assert extra == spec.selective_recompute_flops_per_token() * tokens.numel()


def test_link_table_is_remeasured_when_ranks_would_get_other_thread_counts(tmp_path, monkeypatch):
    """The matmul peak per rank depends on the threads each rank runs; a table measured with
    another count (e.g. every rank on every core, oversubscribed) is not reused."""
    from hsdp_runner.planner import linkbench

    monkeypatch.setattr(linkbench, "cache_path", lambda ranks: tmp_path / f"links_{ranks}.json")
    calls = []

    def fake_measure(ranks):
        calls.append(ranks)
        return {
            "peak_tflops": {"float32": 1.0},
            "links": {kind: {} for kind in linkbench.KINDS},
            "overlap": 0.3,
            "memory_gbps": 5.0,
            "threads_per_rank": linkbench._threads_per_rank(ranks),
            "peak_load": quiet_load(),
        }

    monkeypatch.setattr(linkbench, "measure", fake_measure)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Taken with one thread per rank, before the step end's memory bandwidth was measured:
    # measured again.
    (tmp_path / "links_8.json").write_text(
        json.dumps({"peak_tflops": {}, "links": {}, "overlap": 0.3, "threads_per_rank": 1})
    )
    assert linkbench.cached_or_measure(8)["threads_per_rank"] == 1 and calls == [8]
    assert linkbench.cached_or_measure(8)["threads_per_rank"] == 1 and calls == [8]  # cached
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert linkbench.cached_or_measure(8)["threads_per_rank"] == 2 and calls == [8, 8]


def test_measured_cluster_takes_the_measured_overlap_and_a_null_one_elsewhere_is_an_error(
    monkeypatch,
):
    from hsdp_runner.core.errors import ConfigError
    from hsdp_runner.planner import cluster as cluster_mod
    from hsdp_runner.planner import linkbench

    monkeypatch.setattr(
        linkbench,
        "cached_or_measure",
        lambda ranks: {
            "peak_tflops": {"float32": 0.02},
            "links": {},
            "overlap": 0.32,
            "memory_gbps": 5.0,
            "memory_gib": 16.0,
        },
    )
    node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "cluster" / "this_machine.yaml"))
    assert node["overlap"] is None

    def typed(fields: dict) -> ClusterConfig:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), fields))

    resolved = cluster_mod.resolve(typed(node), "float32")
    assert resolved.overlap == 0.32 and resolved.device_memory_gib == 2.0
    assert resolved.memory_gbps == 5.0
    with pytest.raises(ConfigError, match="cluster.overlap is null"):
        cluster_mod.resolve(
            typed(
                {
                    **node,
                    "measure": False,
                    "peak_tflops": 1.0,
                    "device_memory_gib": 80.0,
                    "nvlink_gbps": 450.0,
                    "nvlink_efficiency": 0.8,
                    "nic_efficiency": 0.96,
                }
            ),
            "float32",
        )


def _overlap_on_two_ranks():
    from hsdp_runner.planner import linkbench

    return linkbench._overlap(rounds=2)


@pytest.mark.multiprocess
def test_overlap_micro_benchmark_gives_a_fraction_on_every_rank():
    from distributed import run_workers

    found = run_workers(_overlap_on_two_ranks, 2)
    assert sorted(found) == [0, 1] and all(0.0 <= v <= 1.0 for v in found.values())
