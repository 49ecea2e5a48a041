"""A rank's matmul peak on its share of this machine's CPUs: measured, judged, cached.

MFU on a CPU and the planner's ``cluster=this_machine`` divide by this figure, so a figure
measured low (other processes loading the machine) inflates MFU and stretches every planned
step. Here:

- ``measure_cpu_peak``: the best of short back-to-back matmul windows (one left out as
  warm-up), with the 1-minute load average read just before (``machine_load``) and the part
  of it the measuring job's own ranks account for; ``MachineLoad.busy`` when the rest kept
  more than ``BUSY_LOAD_FRACTION`` of the CPUs busy. The planner's ``linkbench`` records the
  same ``MachineLoad`` with its measurement of this machine.
- ``cached_cpu_peak``: ``cpu_peak.json`` in ``hardware.cache_dir()``, keyed by host, CPU
  model, CPUs, threads per rank, ranks per node, dtype and torch version. Every entry carries
  its load. A busy one is reused only while the machine is busy now too (measuring again
  then could do no better, and every job on a loaded machine would pay for it); the first run
  on a quiet machine measures again and caches the higher figure. A new figure is cached when
  it beats what is there; a caller whose step beat the cached figure asks for ``remeasure``.
  Entries without a recorded load (written before loads were recorded) are measured again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hsdp_runner.distributed.hardware import cache_dir, cpu_model
from hsdp_runner.models.params import torch_dtype

log = logging.getLogger(__name__)

# A peak measured while processes other than the job's own kept more than this share of the
# CPUs busy (1-minute load average) is busy: another process taking L of c cores lowers a
# rank's measured share by up to L / (c + L), 20% at this threshold.
BUSY_LOAD_FRACTION = 0.25


@dataclass(frozen=True)
class MachineLoad:
    """How loaded the machine was when a figure was measured: ``measured_at`` (Unix time),
    ``loadavg`` (the 1-minute load average), ``own_load`` (the part of it the measuring job's
    own processes account for, ``machine_load``) and ``cpus`` (the machine's CPU count)."""

    measured_at: float
    loadavg: float
    own_load: float
    cpus: int

    @classmethod
    def from_record(cls, record) -> MachineLoad | None:
        """The load a cache file recorded (a dict of the fields); None when there is none or it
        is damaged."""
        try:
            return cls(**record) if isinstance(record, dict) else None
        except TypeError:
            return None

    @property
    def others_load(self) -> float:
        """The load average left once the job's own processes are taken out (never below 0)."""
        return max(0.0, self.loadavg - self.own_load)

    @property
    def busy(self) -> bool:
        """True when other processes kept more than ``BUSY_LOAD_FRACTION`` of the CPUs busy."""
        return self.others_load > BUSY_LOAD_FRACTION * self.cpus

    def age(self, now: float | None = None) -> str:
        """How long ago the figure was measured, e.g. '40 s ago', '2.5 h ago'."""
        age = max(0.0, (time.time() if now is None else now) - self.measured_at)
        if age < 3600:
            return f"{age:.0f} s ago" if age < 60 else f"{age / 60:.0f} min ago"
        return f"{age / 3600:.1f} h ago" if age < 86400 else f"{age / 86400:.1f} d ago"

    def describe(self) -> str:
        """How loaded the machine was, e.g. 'load 0.31 of 2 CPUs (others 0.12)', and ', busy'
        when it was."""
        busy = ", busy" if self.busy else ""
        return f"load {self.loadavg:.2f} of {self.cpus} CPUs (others {self.others_load:.2f}){busy}"


@dataclass(frozen=True)
class CpuPeak:
    """One measurement of a rank's matmul rate on its share of the CPUs: ``tflops`` (the best
    window) and the machine's ``load`` just before."""

    tflops: float
    load: MachineLoad


def process_age_s() -> float:
    """Seconds since this process started (read in ``/proc``); 0 where it cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def machine_load(ranks: int, age_s: float | None = None) -> MachineLoad:
    """The machine's load now, with the part the job's own ``ranks`` processes account for.

    The own part assumes the ranks were runnable since this process started ``age_s`` ago
    (default ``process_age_s()``): the kernel's 1-minute average then holds
    ``ranks x (1 - exp(-age / 60))`` of them."""
    age = process_age_s() if age_s is None else age_s
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average here: the figure records 0
        load = 0.0
    own = ranks * (1.0 - math.exp(-age / 60.0))
    return MachineLoad(time.time(), load, own, os.cpu_count() or 1)


def matmul_tflops(dtype: torch.dtype, size: int = 512, seconds: float = 0.3) -> float:
    """Time square ``size`` matmuls in ``dtype`` for ``seconds`` on this process's CPU
    threads; return the achieved TFLOP/s."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2.0 * size**3 * count / (time.perf_counter() - start) / 1e12


def measure_cpu_peak(
    dtype: torch.dtype, ranks: int = 1, windows: int = 5, seconds: float = 0.06, rate=None
) -> CpuPeak:
    """This rank's matmul peak in ``dtype`` while ``ranks`` ranks of its job measure too:
    the best of ``windows`` back-to-back windows of ``seconds`` (``rate(dtype, seconds)``,
    default ``matmul_tflops``) after one left out, with the load read just before.

    Back to back, not spread with pauses: a rank that paused would hand its share of the CPUs
    to the others. A burst of load from elsewhere lowers some windows; the best is kept. About
    0.36 s, what one 0.3 s window cost before; load lasting longer than that is what
    ``MachineLoad.busy`` is for."""
    rate = rate or (lambda d, s: matmul_tflops(d, seconds=s))
    load = machine_load(ranks)
    rate(dtype, seconds)  # left out: the ranks do not start at the same instant
    return CpuPeak(max(rate(dtype, seconds) for _ in range(windows)), load)


def cpu_peak_cache_file() -> Path:
    """Where measured CPU peaks are kept: ``cpu_peak.json`` in ``hardware.cache_dir()``."""
    return cache_dir() / "cpu_peak.json"


def cpu_key(dtype: str) -> str:
    """The cache key of a rank's CPU peak in ``dtype``: host, CPU model, CPUs, this process's
    threads, the ranks sharing the node (``LOCAL_WORLD_SIZE``) and torch's version."""
    model = cpu_model()
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return (
        f"{platform.node()}|{model}|{os.cpu_count()} cpus|{torch.get_num_threads()} threads"
        f"|{ranks} ranks|{dtype}|torch {torch.__version__}"
    )


def _read_cache(path: Path) -> dict:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _cached_peak(entry) -> CpuPeak | None:
    """A cache entry as a CpuPeak; None for a bare number (written before loads were
    recorded: it may come from a busy machine) or a damaged entry."""
    if not isinstance(entry, dict) or not isinstance(entry.get("tflops"), (int, float)):
        return None
    load = MachineLoad.from_record(entry.get("load"))
    return None if load is None else CpuPeak(float(entry["tflops"]), load)


def cached_cpu_peak(dtype: str, remeasure: bool = False, measure=None) -> tuple[CpuPeak, bool]:
    """This rank's CPU peak in ``dtype`` (a torch dtype name) and whether it came from the
    cache.

    Measured (``measure(torch dtype, ranks)``, default ``measure_cpu_peak``; ranks from
    ``LOCAL_WORLD_SIZE``) when the cache holds no recorded entry for ``cpu_key(dtype)`` or
    ``remeasure`` is set, or when the entry was measured busy and the machine is quiet now.
    The higher of the new and the cached figure is returned (the peak is the best the machine
    reaches) and cached, with its load. Each rank writes a whole file and renames it into
    place; a cache that cannot be read or written is measured around, never an error."""
    path, key = cpu_peak_cache_file(), cpu_key(dtype)
    cached = _read_cache(path)
    known = _cached_peak(cached.get(key))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if known is not None and not remeasure:
        if not known.load.busy or machine_load(ranks).busy:
            return known, True
    peak = (measure or measure_cpu_peak)(torch_dtype(dtype), ranks)
    if known is not None and known.tflops >= peak.tflops:
        return known, True
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cached, key: asdict(peak)}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("could not cache the CPU peak in %s: %s", path, err)
    return peak, False
