"""parallel=auto: the choice, the explicit-degree rule, the cluster a job plans for, which
process plans under torchrun (rank 0, through the agent store) and SLURM (the submitting
process), the fits-nowhere advice, predicted vs measured in summary.json / W&B / compare, and
the CLI (torchrun and submitit jobs: tests/test_many_nodes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clusters import this_machine_cache
from conftest import run_cli
from omegaconf import OmegaConf

from hsdp_runner.config.compose import compose, to_run_config
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.core.records import RunSummary
from hsdp_runner.planner import auto, layouts
from hsdp_runner.planner.cluster import Cluster
from hsdp_runner.report import prediction
from hsdp_runner.runtime import auto_job
from hsdp_runner.train.sinks import wandb_summary

AUTO = [
    "parallel=auto",
    "model=llama3_tiny",
    "trainer.global_batch_size=8",
    "trainer.steps=4",
    "launcher.nproc_per_node=2",
]


def _row(shape, step, mem, fits=True, valid=True) -> dict:
    overrides = {f"parallel.{n}": d for n, d in zip(("dp_replicate", "dp_shard", "tp"), shape)}
    return {
        "overrides": overrides,
        "valid": valid,
        "fits": fits if valid else None,
        "step_time_s": step if valid else None,
        "mem_gib": mem,
        "layout": "x",
        "tps_per_device": 100.0,
        "dominant": "compute",
        "rank": None,
    }


def test_the_fastest_fitting_layout_wins_and_the_next_fitting_one_is_runner_up():
    rows = [
        _row((4, 1, 1), 0.5, 9.0, fits=False),
        _row((1, 4, 1), 0.8, 3.0),
        _row((2, 2, 1), 0.7, 4.0),
        _row((1, 1, 4), None, None, valid=False),
        _row((1, 2, 2), 0.9, 2.0),
    ]
    layouts_ranked = sorted(
        rows, key=lambda e: (not e["valid"], not e["fits"], e["step_time_s"] or 0.0)
    )
    best, second = auto.choose(layouts_ranked)
    assert best["overrides"]["parallel.dp_shard"] == 2 and best["step_time_s"] == 0.7
    assert second["step_time_s"] == 0.8
    assert auto.choose([_row((1, 4, 1), 0.8, 3.0)])[1] is None
    assert auto.choose([_row((4, 1, 1), 0.5, 9.0, fits=False)]) == (None, None)


def test_an_explicit_degree_is_a_constraint_and_one_no_layout_has_exits_naming_the_key():
    cfg = compose(AUTO + ["parallel.tp=2"])
    assert cfg.parallel.auto and auto.fixed_degrees(cfg.parallel) == {"tp": 2}
    assert auto.fixed_degrees(compose(AUTO).parallel) == {}
    every = layouts.enumerate_layouts(to_run_config(cfg), 4, 4)
    kept = layouts.with_degrees(every, {"tp": 2}, 4)
    assert {(2, 1, 1, 2, 1), (1, 2, 1, 2, 1)} <= {e["shape"] for e in kept}
    assert {e["shape"] for e in kept} < {e["shape"] for e in every}
    assert all(e["shape"][3] == 2 for e in kept)
    with pytest.raises(ConfigError, match=r"parallel.tp=3: no layout of 4 ranks has that degree"):
        layouts.with_degrees(every, {"tp": 3}, 4)
    # A degree tuple refused at every ep is one row; asked for at some ep, it keeps its reason.
    experts = layouts.enumerate_layouts(to_run_config(compose(AUTO + ["model=moe_tiny"])), 4, 4)
    (refused,) = layouts.with_degrees(experts, {"tp": 4, "ep": 2}, 4)
    assert refused["shape"] == (1, 1, 1, 4, 1) and refused["same_refusal_eps"] == [2, 4]
    assert refused["reason"].startswith("parallel.tp=4 does not divide model.n_kv_heads=2")


def test_the_cluster_is_the_command_lines_else_the_gpus_preset_else_this_machine():
    assert auto.preset_for_device("NVIDIA H100 80GB HBM3") == "h100_sxm"
    assert auto.preset_for_device("nvidia  a100-sxm4-40gb") == "a100_40gb"
    given = to_run_config(compose(AUTO)).cluster  # None: no cluster on the command line
    node = auto.cluster_node(given, 16, 8, "NVIDIA H200")
    assert (node.name, node.nodes, node.gpus_per_node) == ("h200", 2, 8)
    node = auto.cluster_node(given, 2, 2, None)
    assert (node.name, node.nodes, node.gpus_per_node, node.measure) == ("this_machine", 1, 2, True)
    given = to_run_config(compose(AUTO + ["cluster=a100_80gb"])).cluster
    node = auto.cluster_node(given, 32, 8, "NVIDIA H100 80GB HBM3")  # the command line wins
    assert (node.name, node.nodes, node.gpus_per_node) == ("a100_80gb", 4, 8)
    with pytest.raises(ConfigError, match="no cluster preset has device 'NVIDIA L4'.*cluster="):
        auto.cluster_node(None, 8, 8, "NVIDIA L4")


def test_auto_is_refused_where_no_one_process_can_plan_for_every_rank(monkeypatch):
    cfg = compose(AUTO)
    with pytest.raises(ConfigError, match=r"cluster=<preset> \(a100_40gb, .*this_machine\)"):
        auto_job.check_launch(cfg, 0, submitting=True)  # a login node: no GPU to name one
    auto_job.check_launch(compose(AUTO + ["cluster=h100_sxm"]), 0, submitting=True)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="a launcher other than torchrun or launcher=slurm"):
        auto_job.check_launch(cfg, 0, submitting=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with pytest.raises(ConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        auto_job.check_launch(cfg, 0, submitting=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    auto_job.check_launch(cfg, 0, submitting=False)  # torchrun: rank 0 plans, hands it on
    for name in ("RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name)
    no_ranks = compose([o for o in AUTO if not o.startswith("launcher.")])
    with pytest.raises(ConfigError, match="launcher.nproc_per_node"):
        auto_job.check_launch(no_ranks, 0, submitting=False)
    auto_job.check_launch(no_ranks, 8, submitting=False)  # 8 GPUs: 8 ranks


def test_a_gpu_without_a_preset_is_named_before_anything_is_measured(monkeypatch, tmp_path):
    """The launcher looks up the name torch reports for GPU 0; one no preset has exits 2
    asking for cluster=<preset>, before any fake measurement."""
    monkeypatch.setattr("torch.cuda.get_device_name", lambda index=None: "NVIDIA L4")
    monkeypatch.setattr(layouts.plan_memory, "measure", lambda requests: pytest.fail("measured"))
    with pytest.raises(ConfigError, match="no cluster preset has device 'NVIDIA L4'"):
        auto_job.plan_here(compose(AUTO), 8, 8, 8, tmp_path, [])


@pytest.fixture
def agent_store(monkeypatch):
    """A TCPStore in this process standing in for torchrun's agent store, and the environment
    torchrun's agent gives its workers."""
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    for name, value in {
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "auto-test",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }.items():
        monkeypatch.setenv(name, value)
    return store


def _fake_plan_job(cfg, world_size, ranks_per_node, device_name, out_dir, overrides):
    """plan_job without measuring: dp_shard=2 wins, ddp is the runner-up."""
    best, second = _row((1, 2, 1), 0.5, 1.0), _row((2, 1, 1), 0.6, 1.5)
    node = auto.cluster_node(to_run_config(cfg).cluster, world_size, ranks_per_node, device_name)
    auto.apply_choice(cfg, best["overrides"], out_dir / "plan.json", node)
    cluster = {"name": node.name, "nodes": 1, "gpus_per_node": 2, "device_memory_gib": 8.0}
    return auto.AutoChoice(best, second, cluster, out_dir / "plan.json", 0.1)


def test_under_torchrun_rank_0_plans_and_the_other_ranks_run_its_choice(
    agent_store, monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(auto, "plan_job", _fake_plan_job)
    configs = {}
    for rank in (0, 1):  # rank 0 publishes first; rank 1 would wait for it
        monkeypatch.setenv("RANK", str(rank))
        configs[rank] = compose(AUTO)
        auto_job.settle(configs[rank], 2, 2, 0, tmp_path, [])
        monkeypatch.setattr(auto, "plan_job", lambda *a: pytest.fail("rank 1 planned"))
    assert capsys.readouterr().out.count("parallel=auto chose dp_replicate=1 dp_shard=2") == 1
    for rank, cfg in configs.items():
        assert [cfg.parallel[n] for n in ("dp_replicate", "dp_shard", "tp")] == [1, 2, 1], rank
        assert cfg.plan.source == str(tmp_path / "plan" / "plan.json")
        assert (cfg.cluster.name, cfg.cluster.nodes, cfg.cluster.gpus_per_node) == (
            "this_machine",
            1,
            2,
        )


def test_rank_0s_planning_error_ends_every_rank_and_a_restart_never_reads_an_old_plan(
    agent_store, monkeypatch, tmp_path
):
    def fits_nowhere(*args):
        raise ConfigError("parallel=auto: model llama3_tiny fits on no layout of 2 ranks")

    monkeypatch.setattr(auto, "plan_job", fits_nowhere)
    for rank in (0, 1):  # the same one line on every rank: launch.run_job exits 2 with it
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(ConfigError, match="^parallel=auto: model llama3_tiny fits on no"):
            auto_job.settle(compose(AUTO), 2, 2, 0, tmp_path, [])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted group: rank 0 is late
    with pytest.raises(ConfigError, match=r"no plan within launcher.timeout_s=1 s"):
        auto_job.settle(compose(AUTO + ["launcher.timeout_s=1"]), 2, 2, 0, tmp_path, [])


def test_a_slurm_task_runs_the_plan_made_before_submission(monkeypatch, tmp_path):
    """The submitting process planned into the job's dir; each task writes that plan's choice
    into its config without planning, and refuses a plan for another world size."""
    monkeypatch.setattr(auto, "plan_job", lambda *a: pytest.fail("a task planned"))
    rows = [_row((2, 1, 1), 0.5, 1.0, fits=False), _row((1, 2, 1), 0.6, 1.0)]
    (tmp_path / "plan").mkdir()
    plan_json = tmp_path / "plan" / "plan.json"
    plan_json.write_text(json.dumps({"world_size": 2, "layouts": rows}))
    for name, value in {"SUBMITIT_EXECUTOR": "slurm", "RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    auto_job.check_launch(compose(AUTO), 0, submitting=False)
    cfg = compose(AUTO + ["cluster=h100_sxm"])
    auto_job.settle(cfg, 2, 2, 0, tmp_path, [])
    assert [cfg.parallel[n] for n in ("dp_replicate", "dp_shard", "tp")] == [1, 2, 1]
    assert cfg.plan.source == str(plan_json.resolve()) and cfg.cluster.nodes == 1
    with pytest.raises(ConfigError, match="is for 2 ranks, this job has 4; resubmit"):
        auto_job.settle(compose(AUTO + ["cluster=h100_sxm"]), 4, 2, 0, tmp_path, [])
    with pytest.raises(ConfigError, match="plan .*missing"):
        auto_job.settle(compose(AUTO + ["cluster=h100_sxm"]), 2, 2, 0, tmp_path / "x", [])


def test_a_slurm_jobs_plan_goes_into_the_dir_hydra_will_give_the_job():
    hydra = {
        "job": {"num": 0, "id": "???", "override_dirname": "parallel=auto"},
        "sweep": {"dir": "multirun/s", "subdir": "${hydra.job.num}_${hydra.job.override_dirname}"},
    }
    cfg = OmegaConf.create({"hydra": hydra})
    assert auto_job.submitted_job_dir(cfg, 3) == Path("multirun/s/3_parallel=auto")
    cfg.hydra.sweep.subdir = "${hydra.job.id}"
    with pytest.raises(ConfigError, match=r"leave \$\{hydra.job.id\} out of hydra.sweep.subdir"):
        auto_job.submitted_job_dir(cfg, 3)


def _cluster(**kw) -> Cluster:
    base = dict(
        name="t",
        device="cpu",
        gpus_per_node=4,
        nodes=1,
        device_memory_gib=1.0,
        peak_tflops=1.0,
        peak_source="test",
        compute_efficiency=0.5,
        nvlink_gbps=1.0,
        nvlink_efficiency=1.0,
        nics_per_node=1,
        nic_gbit=8.0,
        nic_efficiency=1.0,
        intra_node_latency_us=10.0,
        inter_node_latency_us=10.0,
        overlap=1.0,
        memory_reserve_gib=0.0,
        memory_gbps=1000.0,
    )
    return Cluster(**{**base, **kw})


def test_fits_nowhere_plans_each_remedy_and_lists_those_that_fit(monkeypatch):
    """Stronger AC, a smaller batch, more micro-batches and more nodes are each planned; the
    message names the ones whose best layout fits, with its degrees and memory."""
    seen = []

    def fake_plan(scenarios, on_error=None):
        seen.extend(scenarios)
        out = []
        for s in scenarios:
            fits = s.cfg.parallel.ac == "full" or s.cluster.nodes == 2
            out.append([_row((1, s.cluster.world_size, 1), 1.0, 0.5 if fits else 2.0, fits)])
        return out

    monkeypatch.setattr(auto, "plan_scenarios", fake_plan)
    cfg = compose(AUTO)
    message = auto.fits_nowhere(cfg, _cluster(), {}, Path("/x/plan/plan.json"))
    assert [s.cfg.parallel.ac for s in seen[:2]] == ["selective", "full"]
    assert seen[2].cfg.trainer.global_batch_size == 4 and seen[4].cluster.world_size == 8
    accum = seen[3].cfg.trainer  # the same global batch in twice the micro-batches
    assert (accum.global_batch_size, accum.grad_accum_steps) == (8, 2)
    assert accum.accum_reduce == "every"
    assert "fits on no layout of 4 ranks x 1 GiB" in message and "/x/plan/plan.md" in message
    assert "would fit: parallel.ac=full (dp_replicate=1 dp_shard=4 tp=1: 0.5 GiB" in message
    assert "launcher.nnodes=2 (8 ranks) (dp_replicate=1 dp_shard=8 tp=1" in message
    assert "parallel.ac=selective (" not in message and "global_batch_size=4 (" not in message
    monkeypatch.setattr(auto, "plan_scenarios", lambda s, on_error=None: [None] * len(s))
    assert (
        "none of parallel.ac=selective, parallel.ac=full, trainer.global_batch_size=4, "
        "trainer.grad_accum_steps=2 trainer.accum_reduce=every, launcher.nnodes=2"
        in auto.fits_nowhere(cfg, _cluster(), {}, Path("/x/plan/plan.json"))
    )


@pytest.mark.parametrize(
    "extra,expected",
    [
        ([], ["moe_act", "selective", "moe", "full"]),
        (["parallel.ac=moe_act"], ["selective", "moe", "full"]),
        (["parallel.ac=moe"], ["full"]),
        # The experts' activation is not recomputed beside float8 experts (refused there).
        (["precision=float8", "precision.float8_experts=true"], ["selective", "moe", "full"]),
        (["model.n_dense_layers=2", "model.n_layers=2"], ["selective", "full"]),
    ],
)
def test_a_moe_job_that_fits_nowhere_tries_each_stronger_recompute(monkeypatch, extra, expected):
    """A model with MoE blocks climbs the recompute settings that keep less: the experts'
    activation, selective, the MoE feed-forward, full; a model of dense blocks only (every
    block dense) the dense ladder."""
    seen = []

    def fake_plan(scenarios, on_error=None):
        seen.extend(scenarios)
        return [None] * len(scenarios)

    monkeypatch.setattr(auto, "plan_scenarios", fake_plan)
    cfg = compose([*AUTO, "model=moe_tiny", *extra])
    auto.remedies(cfg, _cluster(), {})
    assert [s.cfg.parallel.ac for s in seen[: len(expected)]] == expected
    assert seen[len(expected)].cfg.parallel.ac == cfg.parallel.ac  # then the batch's remedies


def test_job_prediction_puts_predicted_next_to_measured_and_names_the_runner_up(tmp_path):
    rows = [
        _row((1, 2, 1), 0.5, 1.0),
        _row((2, 1, 1), 0.6, 1.5),
        _row((1, 1, 2), None, None, valid=False),
    ]
    for rank, row in enumerate(rows[:2], start=1):
        row.update(rank=rank, tps_per_device=1000.0 / rank)
    plan_json = tmp_path / "plan.json"
    plan_json.write_text(json.dumps({"cluster": {"name": "this_machine"}, "layouts": rows}))
    config = {
        "plan": {"source": str(plan_json)},
        "parallel": {"auto": True, "dp_replicate": 1, "dp_shard": 2, "tp": 1},
    }
    summary = RunSummary(
        median_step_time_s=0.4,
        median_tps_per_device=1250.0,
        mem_tensor_peak_gib_per_rank=[0.8, 0.9],
    )
    found = prediction.job_prediction(config, summary)
    assert found["rank"] == 1 and found["cluster"] == "this_machine"
    assert found["figures"]["step_time_s"] == {
        "predicted": 0.5,
        "measured": 0.4,
        "error": pytest.approx(0.25),
    }
    assert found["figures"]["tps_per_device"]["error"] == pytest.approx(-0.2)
    assert found["figures"]["mem_gib"]["measured"] == 0.9
    assert found["runner_up"]["overrides"]["parallel.dp_replicate"] == 2
    summary.prediction = found
    scalars = wandb_summary(summary)
    assert scalars["prediction/step_time_s/predicted"] == 0.5
    assert scalars["prediction/mem_gib/error"] == pytest.approx(1.0 / 0.9 - 1)
    assert prediction.job_prediction({"plan": {"source": None}}, summary) is None


@pytest.fixture(scope="module")
def auto_env(tmp_path_factory) -> dict:
    """A cache dir for the CLI jobs with this machine's link table for 2 ranks in advance."""
    return this_machine_cache(tmp_path_factory.mktemp("cache"))


def _state_bound_gib() -> float:
    """GiB per rank llama3_tiny's one-block training state needs at least on 2 ranks."""
    from hsdp_runner.config.compose import compose, to_run_config
    from hsdp_runner.planner.state_bound import state_lower_bound_gib

    run = to_run_config(compose(["model=llama3_tiny", "model.n_layers=1"]))
    return state_lower_bound_gib(run, 2, 0.0)


@pytest.mark.multiprocess
def test_an_auto_job_that_fits_nowhere_exits_2_before_any_worker_starts(auto_env, tmp_path):
    """(An explicit degree no layout has, and CPU without ranks: tests/test_bad_input.py.)"""
    nowhere = run_cli(
        tmp_path / "nowhere",
        *AUTO,
        "model.n_layers=1",
        "parallel.cp=1",  # fewer layouts to measure, for the job and each remedy
        "parallel.tp=1",
        "cluster=this_machine",
        # Above what the training state alone needs (planner.state_bound), below any peak.
        f"cluster.device_memory_gib={_state_bound_gib() * 1.01}",
        env=auto_env,
        timeout=600,
    )
    assert nowhere.returncode == 2, nowhere.stderr[-2000:]
    error = [line for line in nowhere.stderr.splitlines() if "config error" in line]
    assert len(error) == 1 and "model llama3_tiny fits on no layout of 2 ranks" in error[0]
    assert "none of parallel.ac=selective, parallel.ac=full" in error[0]
    assert (tmp_path / "nowhere" / "plan" / "plan.md").exists()
    assert not (tmp_path / "nowhere" / "logs").exists()  # no worker started


@pytest.mark.multiprocess
def test_multirun_of_auto_jobs_records_the_choice_and_predicted_vs_measured(auto_env, tmp_path):
    """Three models, each planned in the launching process on this machine (2 ranks), run with
    the chosen degrees; summary.json, W&B and compare hold the prediction next to the run. The
    mixture of experts plans ep too (FSDP 2 with ep 1 or 2, DDP). cp and tp are kept at 1 (a
    constraint) so that each plan measures two or three layouts, not four or more: the choice
    among every degree is test_the_fastest_fitting_layout_wins_..."""
    from wandb_records import read_run

    from hsdp_runner import compare

    sweep = tmp_path / "auto_sweep"
    result = run_cli(
        sweep,
        "-m",
        "model=llama3_tiny,gpt2_tiny,moe_tiny",
        *[o for o in AUTO if not o.startswith("model=")],
        "trainer.steps=3",
        "parallel.cp=1",
        "parallel.tp=1",
        "logger=wandb",
        f"hydra.sweep.dir={sweep}",
        pin_dir=False,
        env=auto_env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("hsdp_runner: parallel=auto chose ") == 3
    assert result.stdout.count("runner-up dp_replicate=") == 3
    jobs = sorted(d for d in sweep.iterdir() if (d / "summary.json").exists())
    assert len(jobs) == 3
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        config = OmegaConf.load(job / "config_resolved.yaml")
        plan = json.loads((job / "plan" / "plan.json").read_text())
        chosen = next(e for e in plan["layouts"] if e["valid"] and e["fits"])
        assert [summary[k] for k in ("dp_replicate", "dp_shard", "tp")] == [
            chosen["overrides"][f"parallel.{k}"] for k in ("dp_replicate", "dp_shard", "tp")
        ]
        # ep is planned (and run) for the model with experts alone.
        experts = config.model.name == "moe_tiny"
        assert summary["ep"] == chosen["overrides"].get("parallel.ep", 1)
        assert experts == ("parallel.ep" in chosen["overrides"])
        if experts:
            assert {e["overrides"].get("parallel.ep") for e in plan["layouts"]} == {1, 2}
        assert config.plan.source == str(job / "plan" / "plan.json")
        assert config.cluster.name == "this_machine" and config.cluster.gpus_per_node == 2
        pred = summary["prediction"]
        assert pred["rank"] == 1 and pred["runner_up"] is not None
        assert pred["figures"]["step_time_s"]["measured"] == summary["median_step_time_s"]
        assert pred["figures"]["mem_gib"]["predicted"] == chosen["mem_gib"]
        assert pred["figures"]["mem_gib"]["measured"] == max(
            summary["mem_tensor_peak_gib_per_rank"]
        )
        run = read_run(next(job.glob("wandb/offline-run-*/run-*.wandb")))
        assert run["summary"]["prediction/step_time_s/predicted"] == chosen["step_time_s"]
    assert compare.main([str(sweep)]) == 0
    text = (sweep / "compare.md").read_text()
    assert "## Predicted vs measured" in text and "3 completed jobs with a prediction" in text
