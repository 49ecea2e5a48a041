"""Peak memory held by tensors, counted from a starting point: the planner's measured figure.

On CUDA, ``torch.cuda.max_memory_allocated`` minus the allocation at the start is that figure.
torch keeps no such counter for CPU tensors (``torch.cpu`` has no memory statistics), and the
resident set is no substitute: it also holds library code pages, Python objects and glibc's
heap slack, none of which a model of tensors can predict. So on CPU the meter runs torch's
own profiler with ``profile_memory=True`` from the start point through the first steps: every
CPU allocation and free that c10's allocator reports while it runs, summed in time order; the
peak of that sum is the CPU counterpart of CUDA's allocated peak. Allocations made before the
start are not reported, and neither are their frees, so the sum is exactly what was added.

The profiler is started one level below ``torch.profiler.profile``, which records every
operator and autograd node too and builds all of their events when it stops: about 0.6 CPU-s
a rank for one step of a tiny FSDP(4) model, five times the step. Only ``record_function``
scopes are recorded here (``RecordScope.USER_SCOPE``: a few hundred events a step); the
allocator's reports reach the profiler whatever its scopes, so the peak is the same.

Two things torch prints on that path would land in every CPU job's log: kineto's
``USDT: profiler_start``/``profiler_stop`` lines (whatever ``KINETO_LOG_LEVEL`` says) and a
one-time c10 warning when a block from before the start is freed. The meter starts and stops
the profiler with the process's stderr pointed at /dev/null, and frees one such block inside
that window so the one-time warning is spent there.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    RecordScope,
    _ExperimentalConfig,
)

GIB = 2**30
MEMORY_EVENT = "[memory]"
CPU = torch.autograd.DeviceType.CPU


class TensorMemoryMeter:
    """Measures the peak of tensor memory added since ``start()``, until step ``steps`` is
    reported (which the step loop does after the next step's forward and backward).

    ``device``: the rank's device. ``steps``: how many steps after the start the meter covers
    on CPU (the profiler slows the steps it covers; ``metrics.warmup_steps`` leaves them out
    of the steady state). ``enabled=False`` (e.g. another torch.profiler runs) measures
    nothing and ``peak_gib`` stays None.
    """

    def __init__(self, device: torch.device, steps: int, enabled: bool = True):
        self.device = device
        self.steps = steps
        self.enabled = enabled and steps > 0
        self.start_bytes = 0
        self.peak_gib: float | None = None
        self._profiling = False

    def start(self) -> None:
        """Begin counting: call before the model is built."""
        if not self.enabled:
            return
        if self.device.type == "cuda":
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            return
        older = torch.empty(1)  # freed while profiling: spends c10's one-time warning quietly
        with _quiet_stderr():
            _start_memory_profiler()
            self._profiling = True
            del older

    def wrap(self, after_step, start_step: int):
        """Return an ``after_step(step)`` hook that also stops the meter after step
        ``start_step + steps`` (1-based; ``start_step`` steps were done before this run)."""
        last = start_step + self.steps

        def hook(step: int) -> None:
            if after_step is not None:
                after_step(step)
            if step >= last:
                self.stop()

        return hook

    def stop(self) -> float | None:
        """Stop counting (idempotent) and return the peak in GiB (None when disabled)."""
        if not self.enabled:
            return None
        if self.device.type == "cuda":
            # Read once: later calls (after every later step, and at the end) keep the window
            # the meter covers, as on CPU, instead of growing it over saves and later steps.
            if self.peak_gib is None:
                peak = torch.cuda.max_memory_allocated(self.device) - self.start_bytes
                self.peak_gib = max(peak, 0) / GIB
            return self.peak_gib
        if not self._profiling:
            return self.peak_gib
        self._profiling = False
        with _quiet_stderr():
            results = _disable_profiler()
        self.peak_gib = peak_of(results.events()) / GIB
        return self.peak_gib


def _start_memory_profiler() -> None:
    """Start torch's profiler recording the allocator's reports and user scopes only."""
    config = ProfilerConfig(
        ProfilerState.KINETO,
        False,  # record_shapes
        True,  # profile_memory
        False,  # with_stack
        False,  # with_flops
        False,  # with_modules
        _ExperimentalConfig(),
    )
    activities = {ProfilerActivity.CPU}
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities, {RecordScope.USER_SCOPE})


def peak_of(events) -> int:
    """The peak, in bytes, of the running sum of the CPU memory events among kineto
    ``events`` (an allocation has positive ``nbytes``, a free negative)."""
    changes = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == MEMORY_EVENT and e.device_type() == CPU
    )
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 points at /dev/null inside the block (C++ writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
