"""Measure this machine for the planner: matmul peak per rank and each collective's cost.

The idea of nccl-tests, on the backend this machine trains with (gloo on CPU): ``ranks``
processes start together; each times square matmuls while all others do too (its share of
the machine), then for every group size that divides the rank count the ranks split into
groups of that size that all run the collective at once (as mesh dims do in training), at a
small and a large message. Latency = the small message's time; bandwidth = ring factor x
(large - small bytes) / (large - small time), bytes counted as ``comm_model`` counts them (the
full tensor). Last, how much of an asynchronous collective hides behind compute, as FSDP2
issues its all-gathers ahead of the unit that needs them: every rank times matmuls alone, the
large all-gather over all ranks alone, and both at once (the all-gather issued, the matmuls run,
then the wait); ``overlap`` = the time saved / the compute time, the fraction of compute that
communication can hide behind (``cluster.overlap``). And the memory bandwidth the end of a step
reaches (``cluster.memory_gbps``): every rank at once runs the trainer's two calls,
``clip_grad_norm_`` (foreach) and a fused AdamW step, over one fp32 parameter, bytes counted
as the planner counts them (``train.step_end.STEP_END_ACCESSES``). On CPU gloo's threads share
the cores with the matmuls, so it lies well below a GPU's 1.0, but it is not 0: waiting for
peers hides. The result is cached per host and rank count in ``hardware.cache_dir()`` with the
machine's load when it was measured (``cpu_peak.machine_load``), so only the first plan on a
machine pays the ~20 s; one measured while other processes kept the CPUs busy is measured
again by the next plan.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
SMALL, LARGE = 1 << 10, 1 << 22  # bytes of the full tensor
REPEATS = 5


def cache_path(ranks: int) -> Path:
    """Where this host's measurement for ``ranks`` ranks is kept."""
    from hsdp_runner.distributed.hardware import cache_dir

    return cache_dir() / f"linkbench_{socket.gethostname()}_{ranks}.json"


def cached_or_measure(ranks: int) -> dict:
    """Return the cached measurement for ``ranks`` ranks on this host, measuring it if absent
    or taken with another thread count per rank than a job's ranks get now, on a busy machine
    (``cpu_peak.MachineLoad.busy``: its matmul peak is too low), or before the load, the
    overlap, the memory bandwidth and every collective of ``KINDS`` were recorded."""
    from hsdp_runner.distributed.cpu_peak import MachineLoad

    path = cache_path(ranks)
    if path.exists():
        cached = json.loads(path.read_text())
        current = cached.get("threads_per_rank") == _threads_per_rank(ranks)
        # A peak measured while the machine was busy (or before loads were recorded) is
        # measured again: it is too low, and so is every step the plan prices with it.
        load = MachineLoad.from_record(cached.get("peak_load"))
        quiet = load is not None and not load.busy
        complete = all(kind in cached.get("links", {}) for kind in KINDS)
        if current and quiet and complete and "overlap" in cached and "memory_gbps" in cached:
            return cached
    print(
        f"plan: measuring this machine ({ranks} gloo ranks: matmul peak, collectives); "
        f"cached in {path}",
        flush=True,
    )
    result = measure(ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def measure(ranks: int) -> dict:
    """Run the micro-benchmark on ``ranks`` local processes; return peaks, links and memory."""
    import torch.multiprocessing as mp

    from hsdp_runner.distributed.cpu_peak import machine_load

    load = machine_load(1)  # before the ranks start: the planner's process is the job's own
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.spawn(_worker, args=(ranks, str(Path(tmp) / "store"), str(out)), nprocs=ranks)
        result = json.loads(out.read_text())
    result["peak_load"] = asdict(load)
    result["memory_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    result["host"], result["ranks"] = socket.gethostname(), ranks
    result["threads_per_rank"] = _threads_per_rank(ranks)
    return result


def _threads_per_rank(ranks: int) -> int:
    """The intra-op threads each of ``ranks`` local ranks of a job gets (an ``OMP_NUM_THREADS``
    the user set, else the job's own share of the CPUs)."""
    from hsdp_runner.distributed.hardware import cpu_threads

    return int(os.environ.get("OMP_NUM_THREADS") or cpu_threads(ranks))


def _worker(rank: int, ranks: int, store_path: str, out: str) -> None:
    import warnings

    import torch.distributed as dist

    from hsdp_runner.distributed.cpu_peak import measure_cpu_peak
    from hsdp_runner.distributed.hardware import set_cpu_threads
    from hsdp_runner.models.params import torch_dtype

    warnings.filterwarnings("ignore", category=FutureWarning)
    # The thread count a job's ranks get: with torch's default (every CPU per process) the
    # ranks oversubscribe the cores and the peak comes out several times too low.
    set_cpu_threads(ranks)
    dist.init_process_group(
        "gloo", rank=rank, world_size=ranks, store=dist.FileStore(store_path, ranks)
    )
    try:
        peaks = {}
        for name in ("float32", "bfloat16"):
            dist.barrier()
            # The best of several windows: a busy moment on a shared machine only lowers it.
            peaks[name] = measure_cpu_peak(torch_dtype(name), ranks).tflops
        links: dict = {kind: {} for kind in KINDS}
        for n in [d for d in range(2, ranks + 1) if ranks % d == 0]:
            groups = [dist.new_group(list(range(g, g + n))) for g in range(0, ranks, n)]
            group = groups[rank // n]
            for kind in KINDS:
                small = _time(kind, SMALL, n, group)
                large = _time(kind, LARGE, n, group)
                factor = (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n
                # A loaded machine can time the small message slower than the large one; the
                # slope is bounded by half the large message's whole time.
                bandwidth = factor * (LARGE - SMALL) / max(large - small, 0.5 * large)
                links[kind][str(n)] = [small, bandwidth]
        peaks["overlap"] = _overlap()
        peaks["memory_gbps"] = _step_end_bandwidth()
        mean = {k: sum(_gather_float(v)) / ranks for k, v in peaks.items()}
        if rank == 0:
            overlap, memory_gbps = mean.pop("overlap"), mean.pop("memory_gbps")
            Path(out).write_text(
                json.dumps(
                    {
                        "peak_tflops": mean,
                        "links": links,
                        "overlap": overlap,
                        "memory_gbps": memory_gbps,
                    }
                )
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _overlap(rounds: int = 5) -> float:
    """Fraction of compute an asynchronous large all-gather over every rank hides behind, in
    [0, 1]: (compute alone + all-gather alone - both at once) / compute alone, with the compute
    per round sized to take about as long as one all-gather."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    full, shard = torch.zeros(LARGE // 4), torch.zeros(LARGE // 4 // n)
    a = torch.randn(256, 256)

    def timed(body) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            body()
        dist.barrier()
        return time.perf_counter() - start

    comm = timed(lambda: dist.all_gather_into_tensor(full, shard))
    one_matmul = timed(lambda: a @ a) / rounds
    matmuls = max(1, round(comm / rounds / one_matmul))

    def compute_only():
        for _ in range(matmuls):
            a @ a

    def both():
        work = dist.all_gather_into_tensor(full, shard, async_op=True)
        compute_only()
        work.wait()

    compute = timed(compute_only)
    together = timed(both)
    return min(1.0, max(0.0, (compute + comm - together) / compute))


def _step_end_bandwidth(elements: int = 1 << 22) -> float:
    """GB/s of memory traffic one rank's step end reaches while every rank runs it: the
    trainer's ``clip_grad_norm_`` (foreach) and fused AdamW step over one fp32 parameter of
    ``elements`` (64 MiB of parameter, gradient and moments: beyond the caches), the median of
    ``REPEATS`` rounds after one that creates the moments."""
    import torch
    import torch.distributed as dist

    from hsdp_runner.train.step_end import STEP_END_ACCESSES

    param = torch.nn.Parameter(torch.randn(elements))
    param.grad = torch.randn(elements)
    optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
    times = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_([param], 1.0, foreach=True)
        optimizer.step()
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return elements * param.element_size() * STEP_END_ACCESSES / times[len(times) // 2] / 1e9


def _gather_float(value: float) -> list[float]:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value]))
    return [t.item() for t in out]


def _time(kind: str, nbytes: int, n: int, group) -> float:
    """Median seconds of one collective whose full tensor is ``nbytes``, all groups at once."""
    import torch
    import torch.distributed as dist

    full = torch.zeros(nbytes // 4)
    shard = torch.zeros(nbytes // 4 // n)
    out = torch.empty_like(full) if kind == "all_to_all" else None
    times = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        if kind == "all_gather":
            dist.all_gather_into_tensor(full, shard, group=group)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(shard, full, group=group)
        elif kind == "all_to_all":  # the rank's input is the full tensor, as comm_model counts
            dist.all_to_all_single(out, full, group=group)
        else:
            dist.all_reduce(full, group=group)
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return times[len(times) // 2]
