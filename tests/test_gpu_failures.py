"""A GPU node simulated on CPU, part 2: NCCL failure records and settings, one options object
per mesh group, rank-0 file work outside the collective timeout, initial weights drawn on the
device. docs/gpu.md says what this does and does not prove.
"""

import pytest

# --- NCCL failure semantics ---------------------------------------------------------------------

WATCHDOG_LOG = """\
[rank1] 21:40:01 INFO hsdp_runner: step 2 loss 5.41
[rank1]:[E1122 21:45:02.123 ProcessGroupNCCL.cpp:685] [Rank 1] Watchdog caught collective \
operation timeout: WorkNCCL(SeqNum=812, OpType=_ALLGATHER_BASE, NumelIn=49280, \
NumelOut=98560, Timeout(ms)=300000) ran for 300047 milliseconds before timing out.
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG ID 2 PG GUID 5 Rank 1] Process group watchdog thread terminated with exception
Fatal Python error: Aborted
"""


def test_rank_killed_by_nccl_watchdog_is_reported_with_its_cause_not_signal_6(tmp_path):
    from types import SimpleNamespace

    from hsdp_runner.runtime.launch import _failure_message

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank1.log").write_text(WATCHDOG_LOG)
    (logs / "nccl_trace_rank_1").write_bytes(b"\x80")
    failure = SimpleNamespace(message="Signal 6 (SIGABRT) received by PID 4242", exitcode=-6)
    message = _failure_message(failure, logs, 1)
    assert message.startswith(
        "Signal 6 (SIGABRT) received by PID 4242: Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=812"
    )
    assert f"flight recorder dump: {logs / 'nccl_trace_rank_1'}" in message
    assert "launcher.timeout_s" in message  # the timeout hint now shows


def test_a_python_error_record_is_kept_as_it_is(tmp_path):
    from types import SimpleNamespace

    from hsdp_runner.runtime.launch import _failure_message

    (tmp_path / "rank0.log").write_text(WATCHDOG_LOG)
    failure = SimpleNamespace(message={"message": "RuntimeError: boom"}, exitcode=1)
    assert _failure_message(failure, tmp_path, 0) == "RuntimeError: boom"


def test_nccl_settings_dump_the_flight_recorder_into_the_job_logs(tmp_path):
    from hsdp_runner.runtime.failures import nccl_failure_env

    env = nccl_failure_env(tmp_path / "logs")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # a timed-out rank ends, never hangs
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "logs" / "nccl_trace_rank_")


def test_a_cause_left_by_an_earlier_attempt_is_not_read(tmp_path):
    from hsdp_runner.runtime.failures import cause_from_log, mark_attempt

    (tmp_path / "rank1.log").write_text(WATCHDOG_LOG)
    assert cause_from_log(tmp_path, 1).startswith("Watchdog caught")
    mark_attempt(tmp_path, 1)  # a rerun in the same dir
    assert cause_from_log(tmp_path, 1) is None


def test_a_rank_failing_after_a_peer_died_in_cpp_names_the_peer(tmp_path):
    from hsdp_runner.runtime.failures import failed_facts, mark_attempt

    for rank in (0, 1):
        mark_attempt(tmp_path, rank)
    own = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert failed_facts(tmp_path, 0, own)["failed_rank"] == 0  # no peer died: its own error
    with open(tmp_path / "rank1.log", "a") as log:
        log.write(WATCHDOG_LOG)
    facts = failed_facts(tmp_path, 0, own)
    assert facts["failed_rank"] == 1
    assert facts["error"].startswith(
        "rank 1 died in C++: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812"
    )
    assert "launcher.timeout_s" in facts["error"]
    with open(tmp_path / "rank0.log", "a") as log:  # rank 0's own record quoting rank 1
        log.write(
            "[rank0] 21:45:03 ERROR hsdp_runner: rank 1 failed first: rank 1 died in C++: "
            "Fatal Python error: Aborted\n"
        )
    assert failed_facts(tmp_path, 2, own)["failed_rank"] == 1


def test_a_rank_killed_by_a_signal_comes_before_its_peers_echoes_in_the_same_second():
    from types import SimpleNamespace as Failure

    from hsdp_runner.runtime.failures import first_failure

    # Rank 0 aborted at 10.9 s, noticed at 11.0 s; rank 1's "Connection closed" at 10.95 s.
    echo, aborted = Failure(exitcode=1, timestamp=10), Failure(exitcode=-6, timestamp=11)
    assert first_failure({0: aborted, 1: echo}) == (0, aborted)
    late = Failure(exitcode=-9, timestamp=12)  # killed later: the Python error came first
    assert first_failure({0: late, 1: echo}) == (1, echo)


# Rank 0 as NCCL's watchdog ends it, without torch: its sidecar, then the C-level message and
# SIGABRT (fault.kind=abort's own code).
ABORTING_RANK0 = """
import faulthandler, sys
from pathlib import Path
from hsdp_runner.runtime import sidecar as rank0_sidecar
from hsdp_runner.core.faults import _abort_like_nccl_watchdog
sidecar = rank0_sidecar.start(Path(sys.argv[1]), {"world_size": 2, "layout": "ddp"}, 30)
faulthandler.enable()
if sys.argv[2] == "abort":
    _abort_like_nccl_watchdog(0, 3)
print("a warning from C++", file=sys.stderr, flush=True)
sidecar.stop()
print("after stop", file=sys.stderr)
"""


def _rank0(tmp_path, how: str):
    import subprocess
    import sys

    from conftest import REPO, cli_env

    # The captured stderr is the console: it ends when both rank 0 and its sidecar closed it.
    return subprocess.run(
        [sys.executable, "-c", ABORTING_RANK0, str(tmp_path), how],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_rank0_killed_in_cpp_without_a_launcher_leaves_its_cause_in_log_console_and_summary(
    tmp_path,
):
    import json

    result = _rank0(tmp_path, "abort")
    assert result.returncode == -6
    cause = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3"
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert cause in log and "Fatal Python error: Aborted" in log
    assert (
        cause in result.stderr and "hsdp_runner: rank 0 failed: rank 0 died in C++" in result.stderr
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_rank"] == 0
    assert summary["world_size"] == 2 and cause in summary["error"]
    assert "launcher.timeout_s" in summary["error"]


def test_rank0_ending_on_its_own_gets_its_stderr_back_and_no_failure_record(tmp_path):
    result = _rank0(tmp_path, "stop")
    assert result.returncode == 0
    assert result.stderr.splitlines() == ["a warning from C++", "after stop"]
    assert (tmp_path / "logs" / "rank0.log").read_text() == "a warning from C++\n"
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.multiprocess
def test_rank0_aborted_by_the_nccl_watchdog_is_reported_with_its_cause(job_dir):
    from conftest import TINY, read_job, run_cli

    result = run_cli(
        job_dir, *TINY, "parallel=ddp", "fault.rank=0", "fault.step=2", "fault.kind=abort"
    )
    assert result.returncode == 1
    cause = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2"
    assert "rank 0 failed (exit code -6): Signal 6 (SIGABRT)" in result.stderr, result.stderr
    _, summary = read_job(job_dir)
    assert summary["status"] == "failed" and summary["failed_rank"] == 0
    assert summary["error"].startswith("Signal 6 (SIGABRT) received by PID")
    assert cause in summary["error"] and "launcher.timeout_s" in summary["error"]
    assert cause in result.stderr.split("rank 0 failed")[1]  # in the launcher's line too


# --- a rank that raises: teardown must not wait for its peers -----------------------------------


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_failing_nccl_rank_aborts_its_groups_and_records_its_own_error(
    backend, tmp_path, monkeypatch
):
    """NCCL's destroy_process_group waits for the peers' communicators (read in torch 2.13's
    distributed_c10d.py, not run: no GPU here), so a failing NCCL rank aborts instead; gloo and
    success keep the orderly destroy."""
    import json
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from test_config import compose

    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.core.records import RunInfo
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.runtime import worker
    from hsdp_runner.runtime.failures import mark_attempt

    calls = []
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(worker, "setup_logging", lambda out, rank: mark_attempt(out / "logs", rank))
    monkeypatch.setattr(
        worker.rank0_sidecar, "start", lambda *a: SimpleNamespace(stop=lambda: None)
    )
    monkeypatch.setattr(worker, "faulthandler", SimpleNamespace(enable=lambda **k: None))
    monkeypatch.setattr(worker.StopRequest, "install", lambda self, signals: None)
    monkeypatch.setattr(worker, "set_cpu_threads", lambda n: 1)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append("init"))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(
        "torch.distributed.distributed_c10d._abort_process_group", lambda *a: calls.append("abort")
    )

    def train(*args):
        raise oom

    monkeypatch.setattr(worker, "train_rank", train)
    cfg = compose(["model=llama3_tiny", "logger=none", "parallel=ddp"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 2)
    run_info = RunInfo(
        output_dir=str(tmp_path), group="g", run_name="r", tags=[], multirun=False, overrides=[]
    )
    with pytest.raises(torch.OutOfMemoryError):
        worker.run_worker(to_run_config(cfg), dims, run_info)
    assert calls == ["init", "abort" if backend == "nccl" else "destroy"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_rank"] == 0
    assert summary["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_a_rank_that_finishes_tears_down_in_order_on_nccl_too(monkeypatch):
    import torch.distributed as dist

    from hsdp_runner.runtime.worker import end_process_group

    calls = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(
        "torch.distributed.distributed_c10d._abort_process_group", lambda *a: calls.append("abort")
    )
    end_process_group(failed=False)
    assert calls == ["barrier", "destroy"]


# --- one NCCL options object per mesh group ---------------------------------------------------


def test_every_mesh_group_gets_its_own_nccl_options(monkeypatch):
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    from hsdp_runner.distributed.parallel_dims import ParallelDims

    class Options:
        _timeout = None

    monkeypatch.setattr(
        dist, "ProcessGroupNCCL", type("PG", (), {"Options": Options}), raising=False
    )
    seen = {}

    class FakeMesh:
        def __getitem__(self, names):
            return self

        def _flatten(self, name, backend_override=None):
            seen[name] = backend_override
            return self

    def fake_init(device_type, shape, mesh_dim_names, backend_override):
        seen.update(backend_override)
        return FakeMesh()

    monkeypatch.setattr(device_mesh, "init_device_mesh", fake_init)
    ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=8).build_mesh("cuda", timeout_s=42)
    assert sorted(seen) == ["cp", "dp", "dp_replicate", "dp_shard", "pp", "tp"]
    assert {backend for backend, _ in seen.values()} == {"nccl"}
    options = [opts for _, opts in seen.values()]
    assert len({id(o) for o in options}) == 6  # NCCL's split mutates the options it is given
    assert all(o._timeout.total_seconds() == 42 for o in options)


# --- initial weights drawn on the device --------------------------------------------------------


def test_cpu_initial_weights_are_the_same_values_as_before():
    import torch
    from test_config import compose

    from hsdp_runner.models.llama import Llama

    model = Llama(compose(["model=llama3_tiny"]).model)
    model.init_weights(7)
    params = dict(model.named_parameters())
    # Values the CPU draw gave before weights were drawn on the parameter's device.
    golden = {
        "tok_embeddings.weight": ([0.03461545, 0.00616866, 0.0256436], -0.7227687860532548),
        "layers.1.attention.wo.weight": ([0.00020108, -0.0072222, 0.0139383], -0.00870523175035487),
        "layers.0.feed_forward.w3.weight": (
            [0.01364315, 0.0242396, -0.0200923],
            3.9896071250705063,
        ),
        "norm.weight": ([1.0, 1.0, 1.0], 64.0),
    }
    for name, (first, total) in golden.items():
        value = params[name].detach()
        assert value.flatten()[:3].tolist() == pytest.approx(first, abs=1e-8), name
        assert float(value.double().sum()) == pytest.approx(total, rel=1e-12), name
    assert all(p.device == torch.device("cpu") for p in params.values())


def test_initial_values_are_drawn_on_the_parameters_device_by_a_seeded_generator(monkeypatch):
    import torch

    from hsdp_runner.models import common

    draws = []

    class Generator:  # stands in for a CUDA generator on this CPU-only machine
        def __init__(self, device):
            self.device, self.seed = torch.device(device), None

        def manual_seed(self, seed):
            self.seed = seed
            return self

    def randn(shape, generator, device):
        draws.append((generator.device, generator.seed, torch.device(device)))
        return torch.zeros(shape)

    monkeypatch.setattr(torch, "Generator", Generator)
    monkeypatch.setattr(torch, "randn", randn)
    gpu = torch.device("cuda", 3)
    common.initial_value("layers.0.attention.wq.weight", (4, 4), 7, 0.02, gpu)
    common.initial_value("_orig_mod.layers.0.attention.wq.weight", (4, 4), 7, 0.02, gpu)
    assert draws[0] == (gpu, common.name_seed(7, "layers.0.attention.wq.weight"), gpu)
    assert draws[1] == draws[0]  # the seed is the name's, whatever wraps the module


# --- rank-0 file work outside the collective timeout ----------------------------------------------


def _in_threads(*fns):
    """Run each fn in a thread; return their results or exceptions, in order."""
    import threading

    out = [None] * len(fns)

    def call(i, fn):
        try:
            out[i] = fn()
        except Exception as err:  # noqa: BLE001 - the test inspects it
            out[i] = err

    threads = [threading.Thread(target=call, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_other_ranks_learn_rank0s_file_error_at_once():
    import time

    import torch.distributed as dist

    from hsdp_runner.checkpoint.rank0_io import run_on_rank0

    store = dist.HashStore()

    def fail():
        raise OSError("No space left on device")

    start = time.monotonic()
    got = _in_threads(
        lambda: run_on_rank0("pruning", fail, 60, rank=0, store=store),
        lambda: run_on_rank0("pruning", fail, 60, rank=1, store=store),
    )
    assert isinstance(got[0], OSError)
    assert "rank 0 failed while pruning: OSError: No space left on device" in str(got[1])
    assert time.monotonic() - start < 10


def test_rank0_file_work_is_bounded_by_rank0_wait_s():
    import torch.distributed as dist

    from hsdp_runner.checkpoint.rank0_io import run_on_rank0

    with pytest.raises(
        RuntimeError,
        match=r"rank 0 did not finish exporting within "
        r"checkpoint.rank0_wait_s=0.2 s",
    ):
        run_on_rank0("exporting", lambda: None, 0.2, rank=1, store=dist.HashStore())


COLLECTIVE_TIMEOUT_S, SLOW_PRUNE_S = 10, 14


def _save_while_rank0_prunes_slowly(out: str) -> list[str]:
    import gc
    import time
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist
    from test_config import compose

    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.runtime.rank_training import make_checkpointer, rank_trainer

    cfg = compose(
        [
            "model=llama3_tiny",
            "logger=none",
            "parallel=fsdp",
            "parallel.dp_shard=2",
            "metrics.peak_tflops=1",
            "checkpoint.enable=true",
            "checkpoint.keep_last=1",
            f"launcher.timeout_s={COLLECTIVE_TIMEOUT_S}",
        ]
    )
    dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        trainer, _ = rank_trainer(to_run_config(cfg), timeout_s=COLLECTIVE_TIMEOUT_S)
        ckpt = make_checkpointer(to_run_config(cfg), Path(out), trainer)
        prune = ckpt._prune
        ckpt._prune = lambda newest: (time.sleep(SLOW_PRUNE_S), prune(newest))  # a slow NFS
        ckpt.save(1)
        dist.barrier()  # the next collective after the save
        return sorted(p.name for p in ckpt.folder.iterdir())
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_slow_rank0_prune_longer_than_the_collective_timeout_does_not_fail_the_job(tmp_path):
    from hsdp_runner.runtime.launch import start_local_workers

    results = start_local_workers(_save_while_rank0_prunes_slowly, 2, str(tmp_path))
    assert results == {0: ["step-1"], 1: ["step-1"]}
