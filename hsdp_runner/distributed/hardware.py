"""Which device and how many CPU threads a rank gets, from what the node actually shows it.

- ``pick_device``: ``device`` = auto | cpu | cuda -> this rank's ``torch.device``. The GPU index
  comes from what is visible: in a SLURM task (not under torchrun) one visible GPU is used
  whatever the local rank (SLURM's ``--gpus-per-task=1`` / ``--gpu-bind`` show each task only
  its own GPU); otherwise the local rank indexes the visible GPUs, and local ranks that
  outnumber them are an error, not a crash in ``torch.cuda.set_device`` or NCCL's "Duplicate
  GPU detected".
- ``usable_gpus`` / ``cuda_unusable_cause``: ``torch.cuda.device_count()`` counts GPUs through
  NVML even when torch cannot use them (``torch.cuda.is_available()`` False: a driver older
  than the wheel's CUDA), so availability is checked first and the cause is named: a CPU
  build, ``CUDA_VISIBLE_DEVICES`` hiding them, or torch's own "CUDA initialization" warning.
- ``cuda_fallback_warning``: ``device=auto`` on a node with GPUs that this torch cannot use
  would silently run every rank on the CPU; this names the cause.
- ``check_torch_apis``: the torch build has the distributed APIs the runner uses.
- ``cpu_threads``: intra-op threads per rank from the affinity mask (what SLURM, cgroups or
  ``taskset`` allow this process), not ``os.cpu_count()`` (every core of the node).
- ``cache_dir``: the one folder where measurements of this machine are kept (the CPU peak, the
  planner's memory measurements and link benchmark).
"""

from __future__ import annotations

import importlib
import os
import platform
import warnings
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


CACHE_ENV = "HSDP_RUNNER_CACHE_DIR"
# The planner's earlier name for the same folder, still read (with a warning) when CACHE_ENV
# is unset.
DEPRECATED_CACHE_ENV = "HSDP_RUNNER_CACHE"


def cache_dir(env=None) -> Path:
    """The folder for per-machine measurements: ``$HSDP_RUNNER_CACHE_DIR``, else the
    deprecated ``$HSDP_RUNNER_CACHE`` (with a FutureWarning), else
    ``$XDG_CACHE_HOME/hsdp_runner``, else ``~/.cache/hsdp_runner``. ``env``: the environment
    to read (default ``os.environ``)."""
    env = os.environ if env is None else env
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    if env.get(DEPRECATED_CACHE_ENV):
        warnings.warn(
            f"{DEPRECATED_CACHE_ENV} is deprecated; set {CACHE_ENV} instead (same "
            "meaning: the folder of hsdp_runner's per-machine measurements)",
            FutureWarning,
            stacklevel=2,
        )
        return Path(env[DEPRECATED_CACHE_ENV]).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hsdp_runner"


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name: the first ``model name`` of ``cpuinfo`` (Linux), else the
    machine's architecture (``platform.machine()``), else "cpu". Not ``platform.processor()``:
    on Linux it starts ``uname -p`` (a fork of the rank's whole process) for what is most often
    "unknown"."""
    try:
        with open(cpuinfo) as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


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
        raise ConfigError(
            f"torch {torch.__version__} lacks {', '.join(missing)}; install "
            f"torch>={MIN_TORCH} (the project is tested with torch==2.13.0)"
        )


def gpu_bound_per_task(env=None) -> bool:
    """True when this process is a SLURM task started without torch's elastic agent (the
    runner's ``launcher=slurm``): then SLURM's ``--gpus-per-task=1`` / ``--gpu-bind`` may show
    it only its own GPU, and one visible GPU is this rank's whatever its local rank. Under
    torchrun (``TORCHELASTIC_RUN_ID`` set, also inside ``srun torchrun``) and the local
    launcher every rank of a node sees the same GPUs. ``env``: defaults to ``os.environ``."""
    env = os.environ if env is None else env
    return "SLURM_PROCID" in env and "TORCHELASTIC_RUN_ID" not in env


def check_visible_gpus(local_world_size: int, visible: int, per_task: bool | None = None) -> None:
    """Raise ConfigError when ``local_world_size`` ranks on a node cannot each get a GPU.

    ``visible``: GPUs this process sees. One visible GPU is fine for any number of local ranks
    only where each task sees its own (``per_task``, default ``gpu_bound_per_task()``);
    otherwise each local rank needs its own visible GPU.
    """
    per_task = gpu_bound_per_task() if per_task is None else per_task
    if local_world_size > visible and not (per_task and visible == 1):
        raise ConfigError(
            f"{local_world_size} ranks on this node but only {visible} GPUs are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run at "
            f"most {visible} ranks per node (launcher.nproc_per_node / torchrun "
            "--nproc-per-node), or with launcher=slurm bind one GPU per task "
            "(--gpus-per-task=1): two ranks on one GPU fail in NCCL"
        )


def pick_device(choice: Device, local_rank: int, local_world_size: int = 1) -> torch.device:
    """Return this rank's device for ``device`` = auto | cpu | cuda and make it current.

    Takes the config choice, the rank's index on its node and the ranks on the node. Raises
    ConfigError when ``device=cuda`` sees no GPU or the local ranks outnumber visible GPUs.
    """
    choice = Device(choice)
    if choice is Device.cpu or (choice is Device.auto and not cuda_available()):
        return torch.device("cpu")
    visible = usable_gpus(choice)
    per_task = gpu_bound_per_task()
    check_visible_gpus(local_world_size, visible, per_task)
    if visible == 1 and per_task:
        index = 0
    elif local_rank < visible:
        index = local_rank
    else:
        raise ConfigError(
            f"local rank {local_rank} has no GPU: only {visible} are visible to "
            "this process; run fewer ranks per node"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpus_present(root: Path = Path("/")) -> tuple[int, str]:
    """Count GPUs the OS shows, whether or not torch can use them: (count, vendor).

    NVIDIA: ``/proc/driver/nvidia/gpus/*`` (or ``/dev/nvidia<N>``); AMD: ``/dev/kfd`` plus
    ``/dev/dri/renderD*`` nodes. ``root`` exists for tests.
    """
    nvidia = list((root / "proc/driver/nvidia/gpus").glob("*")) or [
        p for p in (root / "dev").glob("nvidia*") if p.name[6:].isdigit()
    ]
    if nvidia:
        return len(nvidia), "NVIDIA"
    if (root / "dev/kfd").exists():
        return len(list((root / "dev/dri").glob("renderD*"))), "AMD"
    return 0, ""


# torch warns once per process, when CUDA first fails to initialise, with the real cause
# ("CUDA initialization: The NVIDIA driver on your system is too old (found version ...)";
# read in c10/cuda/CUDAFunctions.cpp, not seen on a GPU here); ``cuda_available`` keeps it.
_CUDA_INIT_WARNING = "CUDA initialization"
_cuda_init_warning: str | None = None


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, keeping torch's one-time "CUDA initialization: ..."
    warning (if this call triggers it) for ``cuda_unusable_cause``; other warnings pass on."""
    global _cuda_init_warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    for w in caught:
        if str(w.message).startswith(_CUDA_INIT_WARNING):
            _cuda_init_warning = str(w.message)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return available


def cuda_unusable_cause(root: Path = Path("/")) -> str:
    """Why this torch sees no usable GPU, as one clause: a CPU-only build, GPUs hidden by
    ``CUDA_VISIBLE_DEVICES``, no GPU on the node, or torch's own initialisation warning (a
    driver older than the wheel's CUDA). ``root`` exists for tests."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not (torch.version.cuda or torch.version.hip):
        return (
            f"this torch {torch.__version__} is a CPU-only build; install a CUDA build, e.g. "
            "`make TORCH_SPEC='torch==2.13.0 --index-url "
            "https://download.pytorch.org/whl/<variant>' venv` with the variant your "
            "driver supports (docs/gpu.md, 'Installing torch')"
        )
    if hidden is not None and hidden.strip() in ("", "-1", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={hidden!r} hides them"
    count, _ = gpus_present(root)
    if not count and torch.cuda.device_count() == 0:
        return "this node shows no GPU"
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
    if _cuda_init_warning:
        return f"torch {torch.__version__} ({build}) cannot use them: {_cuda_init_warning}"
    return (
        f"torch {torch.__version__} ({build}) cannot initialise them (a driver older than "
        "this build's CUDA? nvidia-smi's 'CUDA Version' is the newest the driver supports); "
        "`python -c 'import torch; torch.cuda.init()'` says why"
    )


def usable_gpus(choice: str) -> int:
    """GPUs this process can use for ``device`` = auto | cpu | cuda: 0 for cpu, and 0 for auto
    when torch cannot use CUDA. Availability comes first: ``torch.cuda.device_count()`` counts
    through NVML even when ``is_available()`` is False. Raises ConfigError naming the cause
    when ``device=cuda`` has no usable GPU."""
    choice = Device(choice)
    if choice is Device.cpu:
        return 0
    count = torch.cuda.device_count() if cuda_available() else 0
    if count == 0 and choice is Device.cuda:
        raise ConfigError(
            f"device=cuda but no GPU is usable: {cuda_unusable_cause()}; fix that "
            "or set device=cpu (or auto)"
        )
    return count


def cuda_fallback_warning(choice: str, root: Path = Path("/")) -> str | None:
    """With ``device=auto``, say why GPUs on this node go unused; None when nothing is wrong.

    ``device=cpu`` is a deliberate choice and stays quiet; ``device=cuda`` fails elsewhere.
    """
    if Device(choice) is not Device.auto or cuda_available():
        return None
    count, vendor = gpus_present(root)
    if not count:
        return None
    return (
        f"device=auto: {count} {vendor} GPU(s) present but {cuda_unusable_cause(root)}. "
        "Every rank runs on the CPU; set device=cuda to fail instead, or device=cpu if that "
        "is what you want"
    )


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
    """Set ``OMP_NUM_THREADS`` to this rank's share of the CPUs (``cpu_threads``) unless it is
    set already (by the user or the launcher), then torch's intra-op threads to it; return the
    thread count in effect.

    torch reads the variable only when it is imported: a worker forked from a process that
    imported torch before the variable was set (the launcher's own forkserver) would keep that
    process's thread count, every rank using all the CPUs."""
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads(local_world_size)))
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


def _affinity() -> set:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))
