"""The step loop: one host read and one collective of its own per step, NaN steps never
applied, stops agreed by every rank, data made ahead and the same as before, a cached CPU peak.

Host reads are counted by wrapping the Tensor methods that copy a value to the host (``item``,
``tolist``, ``cpu``, ``numpy``, ``__float__``, ``__int__``, ``__bool__``) on the training
thread; collectives by wrapping ``torch.distributed``'s functions and counting the calls made
from the runner's own code (FSDP's and DTensor's belong to the model and are counted by
``test_comm``).
"""

import io
import signal
import threading
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from distributed import run_workers
from test_config import compose

BASE = [
    "model=llama3_tiny",
    "trainer.global_batch_size=4",
    "logger=none",
    "trainer.log_every=100",
    "metrics.peak_tflops=1",
]
FSDP = ["parallel=fsdp", "parallel.dp_shard=2"]
NAN_AT_2 = ["fault.rank=1", "fault.step=2"]  # a NaN loss on rank 1 in step 2
HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)
RUNNER = str(Path(__file__).resolve().parents[1] / "hsdp_runner")


class Tally:
    """Counts host reads on the main thread and collectives issued from hsdp_runner code."""

    def __init__(self):
        self.reads = self.collectives = 0
        self.saved = []

    def __enter__(self):
        import sys

        import torch.distributed as dist

        main = threading.main_thread()

        def read(name, original):
            def wrapper(*args, **kwargs):
                if threading.current_thread() is main:
                    self.reads += 1
                return original(*args, **kwargs)

            return wrapper

        def collective(original):
            def wrapper(*args, **kwargs):
                if sys._getframe(1).f_code.co_filename.startswith(RUNNER):
                    self.collectives += 1
                return original(*args, **kwargs)

            return wrapper

        for name in HOST_READS:
            self.saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
            setattr(torch.Tensor, name, read(name, getattr(torch.Tensor, name)))
        for name in COLLECTIVES:
            self.saved.append((dist, name, getattr(dist, name)))
            setattr(dist, name, collective(getattr(dist, name)))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)


# Typed configs by their overrides, composed in the test's process before the workers start
# (``_scenario_configs``) instead of on every rank.
_COMPOSED: dict[tuple, object] = {}


def _config(overrides):
    from hsdp_runner.config.compose import to_run_config

    key = tuple(overrides)
    if key not in _COMPOSED:
        _COMPOSED[key] = to_run_config(compose(BASE + overrides))
    return _COMPOSED[key]


def _trainer(overrides, device=None):
    from hsdp_runner.runtime.rank_training import rank_trainer

    return rank_trainer(_config(overrides), device)[0]


def _weights(trainer):
    """Full parameters and AdamW step counts (a collective: call on every rank)."""
    params = [p.detach().full_tensor().clone() for p in trainer.parts[0].parameters()]
    steps = [float(s["step"]) for s in trainer.optimizer.state.values()]
    return params, steps


def _count_syncs():
    trainer = _trainer(FSDP + ["trainer.steps=4"])
    per_step = []
    with Tally() as tally:

        def after_step(step):
            per_step.append((step, tally.reads, tally.collectives))

        trainer.fit(after_step=after_step)
    return {
        "per_step": per_step,
        "reads": tally.reads,
        "collectives": tally.collectives,
        "losses": [r["loss"] for r in trainer.records],
    }


def _interleaved():
    """The overhead benchmark's interleaved loop (benchmarks/interleaved_steps.py) on the
    syncs case's job."""
    from benchmarks.interleaved_steps import interleave
    from benchmarks.minimal_fsdp import MinimalLoop

    trainer = _trainer(FSDP + ["trainer.steps=4"])
    minimal = MinimalLoop(2, 1, "llama3_tiny", 4)
    runner_times, minimal_times = interleave(trainer, minimal)
    losses = [r["loss"] for r in trainer.records]
    minimal.close()
    return {"runner": runner_times, "minimal": minimal_times, "losses": losses}


def _nan_skip():
    trainer = _trainer(
        FSDP
        + [
            "trainer.steps=3",
            "trainer.on_nan=skip",
            "fault.kind=nan",
            *NAN_AT_2,
        ]
    )
    seen = {}
    trainer.fit(after_step=lambda step: seen.__setitem__(step, _weights(trainer)))
    return {
        "seen": seen,
        "skipped": [r["skipped"] for r in trainer.records],
        "losses": [r["loss"] for r in trainer.records],
    }


def _nan_stop():
    from hsdp_runner.train.trainer import NonFiniteError

    trainer = _trainer(FSDP + ["trainer.steps=4", "fault.kind=nan", *NAN_AT_2])
    hooked = []
    after_one = {}

    def after_step(step):
        hooked.append(step)
        after_one["weights"] = _weights(trainer)

    try:
        trainer.fit(after_step=after_step)
        error = None
    except NonFiniteError as err:
        error = str(err)
    return {
        "error": error,
        "hooked": hooked,
        "records": [r["step"] for r in trainer.records],
        "unchanged": all(
            torch.equal(a, b) for a, b in zip(_weights(trainer)[0], after_one["weights"][0])
        ),
    }


def _stop_request():
    import torch.distributed as dist

    trainer = _trainer(FSDP + ["trainer.steps=5"])
    stop = NS(signum=None)

    def after_step(step):
        if step == 1 and dist.get_rank() == 1:  # arrives while step 2 is under way
            stop.signum = signal.SIGTERM

    trainer.fit(after_step=after_step, stop=stop)
    return {
        "stopped_by": trainer.stopped_by,
        "last_step": trainer.last_step,
        "adam_steps": _weights(trainer)[1],
    }


# What the scenarios train (composed before the workers start).
SCENARIO_OVERRIDES = (
    FSDP + ["trainer.steps=4"],
    FSDP + ["trainer.steps=3", "trainer.on_nan=skip", "fault.kind=nan", *NAN_AT_2],
    FSDP + ["trainer.steps=4", "fault.kind=nan", "fault.rank=1", "fault.step=2"],
    FSDP + ["trainer.steps=5"],
)


def _scenarios(configs: dict):
    _COMPOSED.update(configs)
    return {
        "syncs": _count_syncs(),
        "skip": _nan_skip(),
        "stop": _nan_stop(),
        "signal": _stop_request(),
        "interleaved": _interleaved(),
    }


@pytest.fixture(scope="module")
def outcomes():
    return run_workers(_scenarios, 2, {tuple(o): _config(o) for o in SCENARIO_OVERRIDES})


@pytest.mark.multiprocess
def test_a_step_reads_the_host_at_most_once_and_issues_one_collective_of_its_own(outcomes):
    for rank, out in outcomes.items():
        s = out["syncs"]
        assert s["reads"] == 4 and s["collectives"] == 4, (rank, s)
        # Step s is read (and handed to after_step) once step s+1's all-reduce is issued.
        assert [step for step, _, _ in s["per_step"]] == [1, 2, 3, 4]
        reads = [r for _, r, _ in s["per_step"]]
        calls = [c for _, _, c in s["per_step"]]
        assert reads == [1, 2, 3, 4] and calls == [2, 3, 4, 4], (rank, s)


@pytest.mark.multiprocess
def test_skipped_nan_step_leaves_weights_and_optimizer_state_untouched(outcomes):
    for rank, out in outcomes.items():
        s = out["skip"]
        assert s["skipped"] == [False, True, False], (rank, s["skipped"])
        (p1, steps1), (p2, steps2), (p3, steps3) = (s["seen"][k] for k in (1, 2, 3))
        assert all(torch.equal(a, b) for a, b in zip(p1, p2)) and steps2 == steps1
        assert not any(torch.equal(a, b) for a, b in zip(p2, p3)) and steps3 == [2.0] * len(steps3)
        assert all(torch.isfinite(p).all() for p in p3)
        assert s["losses"][1] != s["losses"][1] and s["losses"][2] == s["losses"][2]


@pytest.mark.multiprocess
def test_nan_with_on_nan_stop_raises_before_the_step_is_reported_or_checkpointed(outcomes):
    for rank, out in outcomes.items():
        s = out["stop"]
        assert s["error"] and "step 2: loss nan" in s["error"], (rank, s)
        assert s["hooked"] == [1] and s["records"] == [1], (rank, s)
        assert s["unchanged"], "step 3's forward ran, but no update after step 1 may be applied"


@pytest.mark.multiprocess
def test_stop_request_on_one_rank_stops_every_rank_after_the_same_step(outcomes):
    for rank, out in outcomes.items():
        s = out["signal"]
        # Signalled during step 2, after its all-reduce: step 3's carries it; step 4 is dropped.
        assert s["stopped_by"] == signal.SIGTERM and s["last_step"] == 3, (rank, s)
        assert set(s["adam_steps"]) == {3.0}, (rank, s)


@pytest.mark.multiprocess
def test_the_overhead_benchmarks_interleaved_loop_times_both_and_changes_no_runner_result(
    outcomes,
):
    for rank, out in outcomes.items():
        s = out["interleaved"]
        assert len(s["runner"]) == len(s["minimal"]) == 4, (rank, s)
        assert all(t > 0 for t in s["runner"] + s["minimal"]), (rank, s)
        # The minimal loop stepped between the runner's steps leaves the runner's job as it
        # is alone: the same losses, bit for bit, as the syncs case's run of the same config.
        assert s["losses"] == out["syncs"]["losses"], (rank, s["losses"])


def _cuda_sync_warnings():
    import warnings

    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        trainer = _trainer(["parallel=single", "trainer.steps=5", "metrics.comm_step=null"], device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # From step 2 on (step 1 holds one-time set-up): any synchronizing CUDA call warns.
            trainer.fit(after_step=lambda step: torch.cuda.set_sync_debug_mode("warn"))
            torch.cuda.set_sync_debug_mode(0)
        # torch's own notice that the debug mode is a prototype (torch 2.11 on an H200) is
        # not a synchronizing call.
        return [
            str(w.message)
            for w in caught
            if "synchroniz" in str(w.message) and "debug mode is a prototype" not in str(w.message)
        ]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_steps_make_no_synchronizing_call():
    from hsdp_runner.runtime.launch import start_local_workers

    assert start_local_workers(_cuda_sync_warnings, 1)[0] == []


def test_progress_bar_only_on_a_terminal_so_piped_step_lines_stand_alone():
    from hsdp_runner.train.trainer import progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert not progress_bar(20, 0, rank=0, console=Terminal()).disable
    assert progress_bar(20, 0, rank=0, console=io.StringIO()).disable  # a file or a pipe
    assert progress_bar(20, 0, rank=1, console=Terminal()).disable


def test_vectorised_synthetic_chain_equals_the_token_by_token_loop():
    from hsdp_runner.train.data import follow_successors

    gen = torch.Generator().manual_seed(0)
    for n, length, vocab in ((8, 513, 256), (3, 2, 50), (16, 64, 1000)):
        draws = torch.randint(0, vocab, (n, length), generator=gen)
        follow = torch.rand(n, length, generator=gen) < 0.5
        successor = torch.randperm(vocab, generator=gen)
        expected = draws.clone()
        for t in range(1, length):
            expected[:, t] = torch.where(
                follow[:, t], successor[expected[:, t - 1]], expected[:, t]
            )
        assert torch.equal(follow_successors(draws, follow, successor), expected)


def test_prefetched_batches_are_the_batches_of_their_step():
    from hsdp_runner.train.data import Prefetcher, TokenBatches

    batches = TokenBatches(
        NS(kind="synthetic", path=None),
        vocab_size=256,
        seq_len=16,
        global_batch=8,
        dp_rank=1,
        dp_size=2,
        seed=3,
    )
    data = Prefetcher(batches, torch.device("cpu"))
    try:
        for step in (0, 1, 2, 7, 8):  # in order, then a jump (a resume, say)
            x, y = data.get(step)
            want_x, want_y = batches.local_batch(step)
            assert torch.equal(x, want_x) and torch.equal(y, want_y)
    finally:
        data.close()


def test_one_cache_dir_and_the_old_variable_still_works_with_a_warning(tmp_path):
    from hsdp_runner.distributed.hardware import cache_dir

    both = {"HSDP_RUNNER_CACHE_DIR": str(tmp_path / "new"), "HSDP_RUNNER_CACHE": "old"}
    assert cache_dir(both) == tmp_path / "new"
    with pytest.warns(FutureWarning, match="set HSDP_RUNNER_CACHE_DIR instead"):
        assert cache_dir({"HSDP_RUNNER_CACHE": str(tmp_path / "old")}) == tmp_path / "old"
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "hsdp_runner"


def test_cpu_peak_is_measured_once_per_machine_and_thread_count(tmp_path, monkeypatch):
    from hsdp_runner.distributed import cpu_peak
    from hsdp_runner.train import metrics

    monkeypatch.setenv("HSDP_RUNNER_CACHE_DIR", str(tmp_path))
    measured = []
    quiet = cpu_peak.MachineLoad(0.0, 0.0, 0.0, 2)

    def measure(dtype, ranks):
        measured.append(dtype)
        return cpu_peak.CpuPeak(0.5 + len(measured), quiet)

    monkeypatch.setattr(cpu_peak, "measure_cpu_peak", measure)
    first = metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None)
    again = metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None)
    assert first.tflops == again.tflops == 1.5 and len(measured) == 1
    assert "measured now" in first.source and "cached" in again.source
    assert cpu_peak.cpu_peak_cache_file() == tmp_path / "cpu_peak.json"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None).tflops == 2.5
    finally:
        torch.set_num_threads(threads)
    (tmp_path / "cpu_peak.json").write_text("not json")  # a damaged cache is measured around
    assert metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None).tflops == 3.5
