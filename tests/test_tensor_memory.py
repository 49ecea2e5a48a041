"""The tensor-memory meter: the measured side of the planner's memory prediction on CPU."""

import subprocess
import sys

import torch

from hsdp_runner.train.tensor_memory import TensorMemoryMeter

MIB = 2**20


def _mib(gib: float) -> float:
    """GiB to MiB, to 1 KiB: torch allocates a few bytes for scalars along the way."""
    return round(gib * 2**30 / 1024) / 1024


def test_cpu_meter_counts_the_peak_of_tensors_added_since_the_start():
    before = [torch.ones(MIB // 4) for _ in range(4)]  # 4 MiB held before the start
    meter = TensorMemoryMeter(torch.device("cpu"), steps=1)
    meter.start()
    a = torch.ones(2 * MIB // 4)  # 2 MiB
    b = a + 1  # 4 MiB live
    del a
    before.clear()  # frees of older blocks do not lower what was added
    c = torch.ones(MIB // 4)  # 3 MiB live
    peak = meter.stop()
    assert _mib(peak) == 4
    assert meter.stop() == peak  # idempotent
    del b, c


def test_meter_stops_after_its_steps_through_the_after_step_hook():
    seen = []
    meter = TensorMemoryMeter(torch.device("cpu"), steps=2)
    meter.start()
    hook = meter.wrap(seen.append, start_step=3)  # a run resumed after step 3
    x = torch.ones(MIB // 4)
    hook(4)
    assert meter.peak_gib is None
    hook(5)
    assert _mib(meter.peak_gib) == 1 and seen == [4, 5]
    y = torch.ones(4 * MIB)  # after the window: not counted
    hook(6)
    assert _mib(meter.peak_gib) == 1
    del x, y


def test_disabled_meter_measures_nothing():
    meter = TensorMemoryMeter(torch.device("cpu"), steps=2, enabled=False)
    meter.start()
    assert meter.stop() is None and meter.peak_gib is None
    assert TensorMemoryMeter(torch.device("cpu"), steps=0).stop() is None


def test_the_meter_leaves_stderr_clean():
    """kineto's start/stop lines and c10's one-time warning about older blocks would otherwise
    land in every CPU job's log."""
    code = (
        "import torch\nfrom hsdp_runner.train.tensor_memory import TensorMemoryMeter\n"
        "old = [torch.ones(1000) for _ in range(3)]\n"
        "m = TensorMemoryMeter(torch.device('cpu'), steps=1); m.start()\n"
        "x = torch.ones(1000); old.clear(); print(m.stop() > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True" and done.stderr == ""
