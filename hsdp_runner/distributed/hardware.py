"""Which device and how many CPU threads a rank gets, from what the node actually shows it.

- ``pick_device``: ``device`` = auto | cpu | cuda -> this rank's ``torch.device``. The GPU index
  comes from what is visible: one visible GPU is used whatever the local rank (SLURM's
  ``--gpus-per-task=1`` / ``--gpu-bind`` show each task only its own GPU), several are indexed
  by the local rank, and local ranks that outnumber them are an error, not a crash in
  ``torch.cuda.set_device``.
- ``cuda_fallback_warning``: ``device=auto`` on a node with GPUs that this torch cannot use (a
  CPU build, hidden by ``CUDA_VISIBLE_DEVICES``, a driver too old) would silently run every rank
  on the CPU; this names the cause.
- ``check_torch_apis``: the torch build has the distributed APIs the runner uses.
- ``cpu_threads``: intra-op threads per rank from the affinity mask (what SLURM, cgroups or
  ``taskset`` allow this process), not ``os.cpu_count()`` (every core of the node).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch

from hsdp_runner.core.choices import Device
from hsdp_runner.core.errors import ConfigError

# (module, attribute, what needs it) — checked before any worker starts.
REQUIRED_APIS = (
    ("torch.distributed.fsdp", "fully_shard", "FSDP2 (torch>=2.6)"),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy", "FSDP2 mixed precision (torch>=2.6)"),
    ("torch.distributed.device_mesh", "init_device_mesh", "DeviceMesh (torch>=2.4)"),
    ("torch.distributed.tensor", "DTensor", "public DTensor (torch>=2.5)"),
    ("torch.distributed.tensor.parallel", "parallelize_module", "tensor parallel (torch>=2.4)"),
    ("torch.distributed.launcher.api", "elastic_launch", "the elastic launcher"),
)
MIN_TORCH = "2.6"


def check_torch_apis() -> None:
    """Raise ConfigError naming the missing API and the minimum torch version, if any is absent."""
    from torch.distributed.device_mesh import DeviceMesh

    missing = []
    for module, attr, what in REQUIRED_APIS:
        try:
            if not hasattr(importlib.import_module(module), attr):
                missing.append(f"{module}.{attr} ({what})")
        except ImportError:
            missing.append(f"{module}.{attr} ({what})")
    if not hasattr(DeviceMesh, "_flatten"):
        missing.append("DeviceMesh._flatten (torch>=2.6)")
    if missing:
        raise ConfigError(f"torch {torch.__version__} lacks {', '.join(missing)}; install "
                          f"torch>={MIN_TORCH} (the project is tested with torch==2.13.0)")


def check_visible_gpus(local_world_size: int, visible: int) -> None:
    """Raise ConfigError when ``local_world_size`` ranks on a node cannot each get a GPU.

    ``visible``: GPUs this process sees. One visible GPU is fine for any number of local ranks
    (per-task binding shows each task only its own); otherwise each local rank needs its own.
    """
    if visible > 1 and local_world_size > visible:
        raise ConfigError(
            f"{local_world_size} ranks on this node but only {visible} GPUs are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run at "
            f"most {visible} ranks per node (launcher.nproc_per_node / torchrun "
            "--nproc-per-node), or bind one GPU per task (SLURM --gpus-per-task=1)")


def pick_device(choice: Device, local_rank: int, local_world_size: int = 1) -> torch.device:
    """Return this rank's device for ``device`` = auto | cpu | cuda and make it current.

    Takes the config choice, the rank's index on its node and the ranks on the node. Raises
    ConfigError when ``device=cuda`` sees no GPU or the local ranks outnumber visible GPUs.
    """
    choice = Device(choice)
    if choice is Device.cpu or (choice is Device.auto and not torch.cuda.is_available()):
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if visible == 0:
        raise ConfigError("device=cuda but this process sees no CUDA device; set device=cpu or "
                          "check CUDA_VISIBLE_DEVICES")
    check_visible_gpus(local_world_size, visible)
    if visible == 1:
        index = 0
    elif local_rank < visible:
        index = local_rank
    else:
        raise ConfigError(f"local rank {local_rank} has no GPU: only {visible} are visible to "
                          "this process; run fewer ranks per node")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpus_present(root: Path = Path("/")) -> tuple[int, str]:
    """Count GPUs the OS shows, whether or not torch can use them: (count, vendor).

    NVIDIA: ``/proc/driver/nvidia/gpus/*`` (or ``/dev/nvidia<N>``); AMD: ``/dev/kfd`` plus
    ``/dev/dri/renderD*`` nodes. ``root`` exists for tests.
    """
    nvidia = list((root / "proc/driver/nvidia/gpus").glob("*")) or \
        [p for p in (root / "dev").glob("nvidia*") if p.name[6:].isdigit()]
    if nvidia:
        return len(nvidia), "NVIDIA"
    if (root / "dev/kfd").exists():
        return len(list((root / "dev/dri").glob("renderD*"))), "AMD"
    return 0, ""


def cuda_fallback_warning(choice: str, root: Path = Path("/")) -> str | None:
    """With ``device=auto``, say why GPUs on this node go unused; None when nothing is wrong.

    ``device=cpu`` is a deliberate choice and stays quiet; ``device=cuda`` fails elsewhere.
    """
    if Device(choice) is not Device.auto or torch.cuda.is_available():
        return None
    count, vendor = gpus_present(root)
    if not count:
        return None
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not (torch.version.cuda or torch.version.hip):
        cause = (f"this torch {torch.__version__} is a CPU-only build; install a CUDA build, e.g. "
                 "`make TORCH_SPEC='torch==2.13.0 --index-url "
                 "https://download.pytorch.org/whl/cu128' venv` (README 'On a GPU machine')")
    elif hidden is not None and hidden.strip() in ("", "-1", "NoDevFiles"):
        cause = f"CUDA_VISIBLE_DEVICES={hidden!r} hides them"
    else:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
        cause = (f"torch {torch.__version__} ({build}) cannot initialise them (a driver older "
                 "than this build needs?); `python -c 'import torch; torch.cuda.init()'` says why")
    return (f"device=auto: {count} {vendor} GPU(s) present but {cause}. Every rank runs on the "
            "CPU; set device=cuda to fail instead, or device=cpu if that is what you want")


def cpu_threads(local_world_size: int, mask: set | None = None, env=None) -> int:
    """Intra-op CPU threads for one of ``local_world_size`` ranks sharing this node.

    The CPUs are this process's affinity mask (``os.sched_getaffinity``), not the node's count.
    A SLURM task bound to its own CPUs (mask no larger than ``SLURM_CPUS_PER_TASK``) gets all of
    its mask; otherwise the local ranks share the mask.
    """
    env = os.environ if env is None else env
    cpus = len(mask if mask is not None else _affinity())
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and cpus <= int(per_task):
        return max(1, cpus)
    return max(1, cpus // max(1, local_world_size))


def set_cpu_threads(local_world_size: int) -> int:
    """Set ``OMP_NUM_THREADS`` and torch's intra-op threads unless the user set them; return
    the thread count in effect."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads(local_world_size))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return torch.get_num_threads()


def _affinity() -> set:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))
