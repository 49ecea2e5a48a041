"""Count the device kernels one whole training step launches, the runner's against torchtitan's,
on CPU, phase by phase; and what each step holds in memory.

    PYTHONPATH=.:/tmp/titan_k python3 benchmarks/step_ops.py [--layers 2] [--no-titan] [--ops]

(torchtitan 0.2.2 from ``.whl_titan``: ``pip install --no-deps --target /tmp/titan_k
.whl_titan/*.whl``.) One process, one gloo rank. The runner's step is its own ``Trainer.fit``
built as a job builds it (``runtime.rank_training.rank_trainer``: ``model=llama3_1b`` narrowed to
``SHAPE``, ``parallel=single precision=bf16 parallel.ac=selective``, the meters off), so the
bf16 parameters come from FSDP2's ``MixedPrecisionPolicy`` on a one-rank mesh. torchtitan's is
its own ``Trainer.train_step`` (and ``forward_backward_step``) on an object holding what its
``__init__`` would build for ``benchmarks/torchtitan_job.py --mp fsdp``: the llama3 model through
``parallelize_llama`` (op-level selective AC) and ``apply_fsdp`` on the one-rank world mesh, its
fused AdamW, its LR schedulers, no autocast. Both steps: 2 warm-up steps, then the third counted.

Counts follow ``block_ops.py`` (its ``OpCount`` rules: views, empty tensors, detaches do not
launch; norms as CUDA's fused kernels, one op each). A foreach or fused op (clip's norms and
scaling, AdamW, FSDP's copies) is one dispatched op but one CUDA launch per chunk of its tensor
list (``multi_tensor_apply``): those rows are lower bounds at the GPU shape, the same for both
tools where the op is the same. Host-to-device and device-to-host copies are memcpys, not
kernels: they do not run here (everything is on the CPU) and are listed by hand in the docs.
FSDP2's own ops (its copy-in, copy-out, casts, reduce-scatter's chunk-cat and division) are found
by the calling frame (``torch/distributed/fsdp``) and shown apart; c10d collectives apart too.

Memory (``--memory``): every storage an op makes during the counted step is followed until it is
freed (or resized to zero, as FSDP2 frees its unsharded parameters), so the step's peak of
tensor memory added on top of the state held between steps, and what is live then, by the
module and op that made it, are known; and what the forward leaves for backward per region.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.module_tracker import ModuleTracker
from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from block_ops import (  # noqa: E402
    _COUNTER,
    ATTENTION,
    GEMM,
    NO_KERNEL,
    OpCount,
    _FusedNormStandIn,
    _stand_in_moe_kernels,
    cuda_norms,
    launches,
)

aten = torch.ops.aten
# Llama 3 1B's ratios (block_ops.SHAPE) with a vocabulary 2x the width (the GPU job's is 62x).
SHAPE = dict(dim=256, heads=8, kv_heads=2, ffn=1024, seq=64, batch=2, vocab=512, theta=500000.0)
COUNTED_STEP = 2  # 0-based: after two warm-up steps
LR, LR_WARMUP, MIN_LR_RATIO, STEPS = 8e-4, 2, 0.1, 3
FSDP_FRAMES = os.sep + os.path.join("distributed", "fsdp") + os.sep
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional"}
# .item() / .tolist(): a device-to-host memcpy on CUDA, not a kernel.
NO_KERNEL_HERE = NO_KERNEL | {aten._local_scalar_dense.default}
REGIONS = {"tok_embeddings": "embedding", "norm": "final norm", "output": "output"}


def region(tracker: ModuleTracker) -> str:
    """Where the op runs: blocks, embedding, final norm, output, or top (outside them)."""
    names = [p for p in tracker.parents if p != "Global"]
    for name in names:
        if "layers" in name.split("."):
            return "blocks"
    inner = max(names, key=lambda p: p.count("."), default="")
    return REGIONS.get(inner.split(".")[-1], "top")


def from_fsdp() -> bool:
    """Whether FSDP2's own code issued the op (its hooks: copy-in, copy-out, casts)."""
    frame = sys._getframe(2)
    while frame is not None:
        if FSDP_FRAMES in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class StepCount(OpCount):
    """``block_ops.OpCount`` over a whole step: counts only while ``active``; ``phase`` is set
    by the step's wrapped functions; the row of an op is (phase, region); with ``memory`` it
    follows every storage made (``live_bytes``) and keeps the peak's live set."""

    def __init__(self, tracker: ModuleTracker, memory: bool = False):
        super().__init__(tracker)
        self.active, self.memory = False, memory
        self.live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak, self.peak_set = 0, []
        self.marks: dict[str, list] = {}

    def module(self) -> str:
        return region(self.tracker)

    def record(self, name: str, kind: str = "other") -> None:
        if self.active:
            super().record(name, kind)

    def live_bytes(self) -> int:
        return sum(st.nbytes() for st in self.live)

    def snapshot(self) -> list:
        return sorted(
            ((st.nbytes(), *where) for st, where in self.live.items() if st.nbytes()),
            reverse=True,
        )

    def _follow(self, func, out) -> None:
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st not in self.live:
                    self.live[st] = (self.phase, self.module(), func.__name__)
        now = self.live_bytes()
        if now > self.peak:
            self.peak, self.peak_set = now, self.snapshot()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.active:
            return out
        if self.memory:
            self._follow(func, out)
        if func.is_view or func in NO_KERNEL_HERE or not launches(func, out):
            return out
        if func.namespace in COLLECTIVE_NAMESPACES:
            kind = "collective"
        elif from_fsdp():
            kind = "fsdp"
        else:
            kind = "gemm" if func in GEMM else "attention" if func in ATTENTION else "other"
        super().record(func.__name__, kind)
        return out

    def mark(self, name: str) -> None:
        """Keep the live set now (``--memory``), under ``name``."""
        if self.memory and self.active:
            self.marks[name] = self.snapshot()


@contextlib.contextmanager
def patched(owner, name: str, make):
    """``owner.name`` replaced by ``make(original)`` for the block."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def in_phase(mode: StepCount, phase: str, then: str | None = None):
    """A wrapper maker: the wrapped call runs in ``phase``, then ``then`` (default: as before)."""

    def make(original):
        def wrapper(*args, **kwargs):
            before, mode.phase = mode.phase, phase
            try:
                return original(*args, **kwargs)
            finally:
                mode.phase = then or before

        return wrapper

    return make


def backward_phase(mode: StepCount):
    """``Tensor.backward`` in phase backward; the forward's live set marked before it."""

    def make(original):
        def wrapper(self, *args, **kwargs):
            mode.mark("before backward")
            before, mode.phase = mode.phase, "backward"
            try:
                return original(self, *args, **kwargs)
            finally:
                mode.phase = before

        return wrapper

    return make


def one_rank() -> None:
    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="step_ops_"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def runner_overrides(layers: int) -> list[str]:
    s = SHAPE
    return [
        "model=llama3_1b",
        f"model.dim={s['dim']}",
        f"model.n_layers={layers}",
        f"model.n_heads={s['heads']}",
        f"model.n_kv_heads={s['kv_heads']}",
        f"model.ffn_hidden_dim={s['ffn']}",
        f"model.vocab_size={s['vocab']}",
        f"model.seq_len={s['seq']}",
        "parallel=single",
        "precision=bf16",
        "parallel.ac=selective",
        f"trainer.steps={STEPS}",
        f"trainer.global_batch_size={s['batch']}",
        f"optim.lr={LR}",
        f"optim.warmup_steps={LR_WARMUP}",
        f"optim.min_lr_ratio={MIN_LR_RATIO}",
        "metrics.comm_step=null",
        "metrics.memory_steps=0",
        "metrics.peak_tflops=1",
        "logger=none",
    ]


def runner_step(layers: int, memory: bool) -> StepCount:
    """The runner's third step of ``Trainer.fit``, counted by phase."""
    from hsdp_runner.config.compose import compose, to_run_config
    from hsdp_runner.distributed import step_stats
    from hsdp_runner.runtime.rank_training import rank_trainer
    from hsdp_runner.train import trainer as trainer_mod
    from hsdp_runner.train.data import Prefetcher

    torch.manual_seed(0)
    trainer, _ = rank_trainer(to_run_config(compose(runner_overrides(layers))))
    with ModuleTracker() as tracker, StepCount(tracker, memory) as mode:
        _COUNTER.append(mode)

        def start(original):
            def wrapper(step, *args, **kwargs):
                mode.active, mode.phase = step == COUNTED_STEP, "forward"
                return original(step, *args, **kwargs)

            return wrapper

        def stop(original):
            def wrapper(self, step, *args, **kwargs):
                before, mode.phase = mode.phase, "step statistics"
                original(self, step, *args, **kwargs)
                mode.phase = before
                if step == COUNTED_STEP:
                    mode.active = False

            return wrapper

        schedule = trainer.schedule
        with contextlib.ExitStack() as stack:
            for owner, name, make in (
                (trainer, "_forward_backward", start),
                (step_stats.PendingStep, "__init__", stop),
                (Prefetcher, "get", in_phase(mode, "data", "forward")),
                (schedule, "_loss_fn", in_phase(mode, "loss", "loss")),
                (torch.Tensor, "backward", backward_phase(mode)),
                (trainer_mod, "local_norm_square", in_phase(mode, "clip", "step statistics")),
                (step_stats, "pack", in_phase(mode, "step statistics")),
                (trainer_mod, "scale_to_norm", in_phase(mode, "clip")),
                (trainer, "_update", in_phase(mode, "optimizer")),
                (trainer.scheduler, "step", in_phase(mode, "lr scheduler")),
            ):
                stack.enter_context(patched(owner, name, make))
            trainer.fit()
        _COUNTER.pop()
    return mode


def titan_model(layers: int):
    """torchtitan's llama3 (its parallelize_llama, then apply_fsdp on the world mesh, as
    torchtitan_job.py --mp fsdp does), its norms as CUDA's fused kernels."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import JobConfig
    from torchtitan.models.llama3.infra import parallelize as titan_par
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    s = SHAPE
    titan_dims.device_type = "cpu"
    job = JobConfig()
    job.training.seq_len, job.training.local_batch_size = s["seq"], s["batch"]
    job.training.steps, job.training.max_norm = STEPS, 1.0
    job.training.mixed_precision_param, job.training.mixed_precision_reduce = (
        "bfloat16",
        "float32",
    )
    job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option = (
        "selective",
        "op",
    )
    job.activation_checkpoint.preserve_rng_state = False
    job.optimizer.lr, job.optimizer.implementation = LR, "fused"
    job.lr_scheduler.warmup_steps, job.lr_scheduler.decay_type = LR_WARMUP, "cosine"
    job.lr_scheduler.min_lr_factor = MIN_LR_RATIO
    # CPU's SDPA op stands in for CUDA's in the save list (block_ops.titan_block does the same).
    titan_par._op_sac_save_list.add(aten._scaled_dot_product_flash_attention_for_cpu.default)
    dims = titan_dims.ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1
    )
    args = TransformerModelArgs(
        dim=s["dim"],
        n_layers=layers,
        n_heads=s["heads"],
        n_kv_heads=s["kv_heads"],
        vocab_size=s["vocab"],
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=s["theta"],
        max_seq_len=s["seq"],
    )
    with torch.device("meta"):
        model = Transformer(args)
    assert model.layers["0"].feed_forward.w1.out_features == s["ffn"]
    for norm in [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]:
        norm.forward = lambda x, n=norm: _FusedNormStandIn.apply(x, n.weight, n.eps)
    model = titan_par.parallelize_llama(model, dims, job)
    titan_par.apply_fsdp(model, dims.world_mesh, torch.bfloat16, torch.float32, pp_enabled=False)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, dims, job


def titan_trainer(layers: int):
    """An object of torchtitan's ``Trainer`` class holding what its ``train_step`` reads."""
    from torchtitan import train as titan_train
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import utils as dist_utils

    torch.manual_seed(0)
    model, dims, job = titan_model(layers)
    t = object.__new__(titan_train.Trainer)
    t.job_config, t.parallel_dims, t.model_parts = job, dims, [model]
    t.device, t.step, t.ntokens_seen = torch.device("cpu"), 0, 0
    t.gradient_accumulation_steps, t.model_args = 1, model.model_args
    t.loss_fn = cross_entropy_loss
    t.train_context = dist_utils.get_train_context(False)
    t.maybe_enable_amp = contextlib.nullcontext()  # FSDP's policy casts (torchtitan_job)
    t.optimizers = build_optimizers([model], job.optimizer, dims)
    t.lr_schedulers = build_lr_schedulers(t.optimizers, job.lr_scheduler, STEPS)
    t.checkpointer = type("NoCheckpoint", (), {"maybe_wait_for_staging": lambda self: None})()
    t.metrics_processor = type(
        "Logged", (), {"should_log": lambda self, step: True, "log": lambda self, *a, **k: None}
    )()
    return t, dist_utils


def titan_batches():
    """torchtitan's samples, ({"input": ids[:-1]}, ids[1:]), batched."""
    s = SHAPE
    gen = torch.Generator().manual_seed(1234)
    while True:
        ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=gen)
        yield {"input": ids[:, :-1]}, ids[:, 1:]


def titan_step(layers: int, memory: bool) -> StepCount:
    """torchtitan's third ``train_step``, counted by phase. The valid-token count of the batch
    runs on the host in torchtitan (labels still on the CPU): phase ``host``, not counted."""
    t, dist_utils = titan_trainer(layers)
    batches = titan_batches()
    with ModuleTracker() as tracker, StepCount(tracker, memory) as mode:
        _COUNTER.append(mode)

        class Data:
            def __next__(self):
                mode.phase = "host"
                return next(batches)

        def fb(original):
            def wrapper(*args, **kwargs):
                mode.phase = "forward"
                out = original(*args, **kwargs)
                mode.phase = "step statistics"
                return out

            return wrapper

        def tokens_to_device(original):
            # local_valid_tokens.to(device) then .float(): the first device op of the step.
            def wrapper(self, *args, **kwargs):
                out = original(self, *args, **kwargs)
                if mode.phase == "host" and self.dtype == torch.int64 and self.dim() == 0:
                    mode.phase = "data"
                return out

            return wrapper

        with contextlib.ExitStack() as stack:
            for owner, name, make in (
                (t, "forward_backward_step", fb),
                (t, "loss_fn", in_phase(mode, "loss", "loss")),
                (torch.Tensor, "backward", backward_phase(mode)),
                (torch.Tensor, "to", tokens_to_device),
                (dist_utils, "clip_grad_norm_", in_phase(mode, "clip")),
                (t.optimizers, "step", in_phase(mode, "optimizer")),
                (t.optimizers, "zero_grad", in_phase(mode, "optimizer")),
                (t.lr_schedulers, "step", in_phase(mode, "lr scheduler", "step statistics")),
            ):
                stack.enter_context(patched(owner, name, make))
            data = Data()
            for step in range(STEPS):
                mode.active = step == COUNTED_STEP
                t.step = step + 1
                t.train_step(data)
            mode.active = False
        _COUNTER.pop()
    return mode


def rows(counts: Counter, host: bool = False) -> dict:
    """{row: {kind: count}}: the row is the phase, split by region in forward and backward;
    FSDP's own ops and collectives in rows of their own."""
    out: dict = defaultdict(Counter)
    for (phase, where, kind, _), n in counts.items():
        if phase == "host" and not host:
            continue
        if kind in ("fsdp", "collective"):
            row = f"FSDP {kind} ({phase})" if kind == "fsdp" else f"collectives ({phase})"
        elif phase in ("forward", "backward"):
            row = f"{phase}: {where}"
        else:
            row = phase
        out[row]["gemm" if kind in ("gemm",) else "other"] += n
    return out


ORDER = [
    "data",
    "forward: embedding",
    "forward: blocks",
    "forward: final norm",
    "forward: output",
    "forward: top",
    "loss",
    "backward: output",
    "backward: final norm",
    "backward: blocks",
    "backward: embedding",
    "backward: top",
    "FSDP fsdp (forward)",
    "FSDP fsdp (backward)",
    "collectives (forward)",
    "collectives (backward)",
    "clip",
    "optimizer",
    "step statistics",
    "lr scheduler",
]


def print_table(results: dict, layers: int) -> None:
    tools = list(results)
    table = {t: rows(r) for t, r in results.items()}
    names = ORDER + sorted({k for r in table.values() for k in r} - set(ORDER))
    print(f"kernel-launching ops of one step ({layers} blocks), non-GEMM (GEMM):")
    print("phase".ljust(26) + "".join(f"{t:>16}" for t in tools))
    totals = {t: Counter() for t in tools}
    for name in names:
        if not any(name in table[t] for t in tools):
            continue
        line = name.ljust(26)
        for t in tools:
            c = table[t].get(name, Counter())
            totals[t] += c
            line += f"{c['other']:>10} ({c['gemm']:>3})"
        print(line)
    print(
        "total".ljust(26)
        + "".join(f"{totals[t]['other']:>10} ({totals[t]['gemm']:>3})" for t in tools)
    )


def by_name(counts: Counter) -> dict:
    out: dict = defaultdict(Counter)
    for (phase, where, kind, name), n in counts.items():
        if phase in ("forward", "backward") and kind == "other" and where == "blocks":
            continue
        out[f"{phase}/{where}/{kind}"][name] += n
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


def memory_report(mode: StepCount, tokens: int) -> dict:
    """What the forward left for backward by region, and the step's peak with its live set."""

    def group(snapshot):
        out: dict = defaultdict(int)
        for nbytes, phase, where, _op in snapshot:
            out[f"{phase}/{where}"] += nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    return {
        "tokens": tokens,
        "before_backward_bytes": group(mode.marks.get("before backward", [])),
        "peak_bytes": mode.peak,
        "peak_by_region": group(mode.peak_set),
        "peak_largest": [list(x) for x in mode.peak_set[:12]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--no-titan", action="store_true")
    p.add_argument("--ops", action="store_true", help="print the ops outside the blocks by name")
    p.add_argument("--memory", action="store_true", help="follow the step's tensor memory")
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(1)
    one_rank()
    steps = {"runner": runner_step}
    if not a.no_titan:
        _stand_in_moe_kernels()
        from torchtitan_job import _stand_in_datasets

        _stand_in_datasets()
        steps["torchtitan"] = titan_step
    results, memory = {}, {}
    with cuda_norms():
        for tool, step in steps.items():
            mode = step(a.layers, a.memory)
            results[tool] = mode.counts
            if a.memory:
                memory[tool] = memory_report(mode, SHAPE["batch"] * SHAPE["seq"])
    print_table(results, a.layers)
    if a.ops:
        print(json.dumps({t: by_name(c) for t, c in results.items()}, indent=1))
    if a.memory:
        print(json.dumps(memory, indent=1))
    if a.json:
        out = {t: {"rows": rows(c), "ops": by_name(c)} for t, c in results.items()}
        Path(a.json).write_text(json.dumps({"counts": out, "memory": memory}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
