"""Count the device kernels one Llama-3 block launches, the runner's against torchtitan's, on CPU.

    PYTHONPATH=.:/tmp/titan_k python3 benchmarks/block_ops.py [--no-titan] [--json out.json]

(torchtitan 0.2.2 from ``.whl_titan``: ``pip install --no-deps --target /tmp/titan_k
.whl_titan/torchtitan-*.whl``.) Both blocks run in bf16 (the parameters FSDP's
``MixedPrecisionPolicy`` hands a block) at a small shape with Llama 3 1B's ratios (4 query
heads per key head, SwiGLU 4x), wrapped in each tool's op-level selective AC
(``parallelize.selective_policy``; torchtitan's ``_apply_op_sac`` with its save list, where
CPU's SDPA op stands in for CUDA's), forward then backward, under a dispatch mode that counts
every aten op that launches a kernel on CUDA: views, empty tensors and detaches do not. The
pass an op belongs to: forward, backward; the selective-AC recompute is the backward's count
with AC minus without (``--ops`` prints each op by name). Each op is attributed to the
innermost submodule that ran it: exact in forward; in backward ``ModuleTracker``'s guess (the
input-gradient sums of a module's inputs land on a neighbour), so a module's row is reliable
in total, the per-pass split of the rows under AC less so.

The norms are counted as CUDA runs them: torch's fused RMSNorm kernels (``aten._fused_rms_norm``
forward, ``_fused_rms_norm_backward``), one op each, in both tools (the runner's
``RMSNormFunction`` on a ``FUSED_NORM_DEVICES`` device; torchtitan's ``nn.RMSNorm`` through
``F.rms_norm``, which a CUDA build sends to the same kernel). A CUDA kernel may launch more than
one grid (the fused norm's backward reduces the weight's gradient in a second kernel): counts
are dispatched ops, a lower bound of launches, the same bound for both tools.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.module_tracker import ModuleTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hsdp_runner.distributed.parallelize import SDPA_FORWARD_OPS, selective_policy  # noqa: E402
from hsdp_runner.models import common, norm_rope  # noqa: E402

aten = torch.ops.aten
# Llama 3 1B's ratios at a CPU size: width 256, 8 heads of 32, 2 key/value heads, SwiGLU 1024.
SHAPE = dict(dim=256, heads=8, kv_heads=2, ffn=1024, seq=64, batch=2, theta=500000.0)
NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.detach.default,
    aten.lift_fresh.default,
    aten._unsafe_view.default,
}
GEMM = {aten.mm.default, aten.addmm.default, aten.bmm.default}
ATTENTION = {getattr(aten, n).default for n in SDPA_FORWARD_OPS if hasattr(aten, n)} | {
    getattr(aten, f"{n}_backward").default
    for n in SDPA_FORWARD_OPS
    if hasattr(aten, f"{n}_backward")
}


def launches(func, out) -> bool:
    """Whether ``func`` (not a view, not in ``NO_KERNEL``) does device work: it returns a tensor,
    or it writes one in place and returns nothing (``_foreach_mul_``, ``_fused_adamw_``)."""
    if any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(out)):
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


class OpCount(TorchDispatchMode):
    """Counts launching ops by (pass, module, kind, op name); ``record`` adds one by hand."""

    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker, self.phase = tracker, "forward"
        self.counts: Counter = Counter()

    def module(self) -> str:
        parents = [p for p in self.tracker.parents if p != "Global"]
        # The innermost: the longest dotted name.
        return max(parents, key=lambda p: p.count("."), default="block")

    def record(self, name: str, kind: str = "other") -> None:
        self.counts[(self.phase, self.module(), kind, name)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func in NO_KERNEL or not launches(func, out):
            return out
        kind = "gemm" if func in GEMM else "attention" if func in ATTENTION else "other"
        self.record(func.__name__, kind)
        return out


_COUNTER: list[OpCount] = []


def _norm_grads(grad, x, rstd, weight):
    """The fused backward's gradients of ``x`` and the weight (fp32 inside, rounded once), so
    that a whole training step stays finite (``step_ops.py``); not counted."""
    normed = x.float() * rstd
    grad_normed = grad.float() * weight.float()
    dot = (grad_normed * normed).mean(-1, keepdim=True)
    grad_x = ((grad_normed - normed * dot) * rstd).to(x.dtype)
    grad_w = (grad.float() * normed).sum(tuple(range(x.dim() - 1))).to(weight.dtype)
    return grad_x, grad_w


class _FusedNormStandIn(torch.autograd.Function):
    """torchtitan's ``nn.RMSNorm`` as CUDA runs it: one fused kernel forward, one backward."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        with _disable_current_modes():
            out = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        if _COUNTER:
            _COUNTER[-1].record("_fused_rms_norm")
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if _COUNTER:
            _COUNTER[-1].record("_fused_rms_norm_backward")
        with _disable_current_modes():
            rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + ctx.eps)
            grad_x, grad_w = _norm_grads(grad, x, rstd, weight)
            return grad_x, grad_w, None


@contextlib.contextmanager
def cuda_norms():
    """The runner's norms take their fused path on CPU, each fused call counted as one op."""
    fwd, bwd = norm_rope.fused_rms_norm, norm_rope.fused_rms_norm_backward

    def fused_forward(x, eps):
        with _disable_current_modes():
            xf = x.float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            out = ((xf * rstd).to(x.dtype), rstd)
        _COUNTER[-1].record("_fused_rms_norm")
        return out

    def fused_backward(grad, x, rstd, weight, needs):
        _COUNTER[-1].record("_fused_rms_norm_backward")
        with _disable_current_modes():
            return _norm_grads(grad, x, rstd, weight)

    norm_rope.FUSED_NORM_DEVICES.add("cpu")
    norm_rope.fused_rms_norm, norm_rope.fused_rms_norm_backward = fused_forward, fused_backward
    try:
        yield
    finally:
        norm_rope.FUSED_NORM_DEVICES.discard("cpu")
        norm_rope.fused_rms_norm, norm_rope.fused_rms_norm_backward = fwd, bwd


def runner_block(ac: bool):
    """The runner's Llama block (bf16), its call on x, and the block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from hsdp_runner.models.llama import LlamaConfig, TransformerBlock

    s = SHAPE
    cfg = LlamaConfig(
        name="t",
        dim=s["dim"],
        n_layers=1,
        n_heads=s["heads"],
        n_kv_heads=s["kv_heads"],
        vocab_size=256,
        ffn_hidden_dim=s["ffn"],
        seq_len=s["seq"],
        rope_theta=s["theta"],
    )
    block = TransformerBlock(cfg).to(torch.bfloat16)
    cos, sin = norm_rope.rope_tables(s["dim"] // s["heads"], s["seq"], s["theta"])
    if ac:
        block = checkpoint_wrapper(
            block,
            preserve_rng_state=False,
            context_fn=lambda: create_selective_checkpoint_contexts(selective_policy()),
        )
    return block, lambda x: block(x, cos, sin)


def _stand_in_moe_kernels() -> None:
    """Stand-ins where triton or tensorboard is not installed (CPU torch): for torchtitan's
    Triton MoE kernels module and torch's tensorboard writer, which its package imports and
    nothing here calls."""
    import importlib.util
    import types

    if importlib.util.find_spec("triton") is None:
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = None
        sys.modules["torchtitan.models.moe.kernels"] = kernels
    if importlib.util.find_spec("tensorboard") is None:  # torchtitan's metrics import it
        board = types.ModuleType("torch.utils.tensorboard")
        board.SummaryWriter = None
        sys.modules["torch.utils.tensorboard"] = board


def titan_block(ac: bool):
    """torchtitan 0.2.2's Llama 3 block (bf16, norms as CUDA runs them), its call on x."""
    _stand_in_moe_kernels()
    from torchtitan_job import _stand_in_datasets

    _stand_in_datasets()
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import _apply_op_sac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import TransformerBlock, precompute_freqs_cis

    s = SHAPE
    args = TransformerModelArgs(
        dim=s["dim"],
        n_layers=1,
        n_heads=s["heads"],
        n_kv_heads=s["kv_heads"],
        vocab_size=256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=s["theta"],
        max_seq_len=s["seq"],
    )
    block = TransformerBlock(0, args).to(torch.bfloat16)
    assert block.feed_forward.w1.out_features == s["ffn"], block.feed_forward.w1
    for norm in (block.attention_norm, block.ffn_norm):
        norm.forward = lambda x, n=norm: _FusedNormStandIn.apply(x, n.weight, n.eps)
    freqs = precompute_freqs_cis(s["dim"] // s["heads"], s["seq"], s["theta"])
    if ac:
        # CPU's SDPA op stands in for CUDA's (saved in both tools' lists).
        save = set(_op_sac_save_list) | {aten._scaled_dot_product_flash_attention_for_cpu.default}
        block = _apply_op_sac(block, ActivationCheckpoint(), op_sac_save_list=save)
    return block, lambda x: block(x, freqs, None)


def count(build, ac: bool) -> Counter:
    """Counts of one forward and backward of the block ``build(ac)`` makes."""
    torch.manual_seed(0)
    block, call = build(ac)
    s = SHAPE
    x = torch.randn(s["batch"], s["seq"], s["dim"], dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    with ModuleTracker() as tracker, OpCount(tracker) as mode:
        _COUNTER.append(mode)
        try:
            out = call(x)
            mode.phase = "backward"
            out.backward(grad)
        finally:
            _COUNTER.pop()
    return mode.counts


def short(module: str) -> str:
    """A module name without the wrapper parts, relative to the block."""
    parts = [p for p in module.split(".") if p not in common.WRAPPER_PARTS]
    parts = [p for p in parts if p not in ("TransformerBlock", "CheckpointWrapper")]
    return ".".join(parts) or "block"


def table(counts_ac: Counter, counts_plain: Counter) -> dict:
    """{module: {forward, recompute, backward}} of non-GEMM, non-attention ops, and totals."""
    out: dict = defaultdict(lambda: defaultdict(int))
    for (phase, module, kind, _), n in counts_ac.items():
        key = short(module) if kind == "other" else kind
        out[key][phase] += n
    for (phase, module, kind, _), n in counts_plain.items():
        if phase == "backward":
            key = short(module) if kind == "other" else kind
            out[key]["recompute"] += 0
            out[key]["backward_plain"] += n
    for row in out.values():
        row["recompute"] = row["backward"] - row.get("backward_plain", 0)
        row["backward"] = row.pop("backward_plain", 0)
    return {k: dict(v) for k, v in out.items()}


def ops_by_name(counts: Counter, phase: str) -> dict:
    names: Counter = Counter()
    for (p, module, _kind, name), n in counts.items():
        if p == phase:
            names[f"{short(module)}:{name}"] += n
    return dict(sorted(names.items()))


def report(tools: dict) -> dict:
    with cuda_norms():
        results = {}
        for tool, build in tools.items():
            ac, plain = count(build, True), count(build, False)
            results[tool] = {
                "modules": table(ac, plain),
                "forward_ops": ops_by_name(ac, "forward"),
                "backward_ops_no_ac": ops_by_name(plain, "backward"),
                "backward_ops_with_recompute": ops_by_name(ac, "backward"),
            }
    return results


def print_table(results: dict) -> None:
    tools = list(results)
    modules = sorted({m for r in results.values() for m in r["modules"]})
    head = "module".ljust(28) + "".join(f"{t:>26}" for t in tools)
    print("launching ops per block: forward / SAC recompute / backward = total")
    print(head)
    totals = {t: [0, 0, 0] for t in tools}
    for m in modules:
        line = m.ljust(28)
        for t in tools:
            row = results[t]["modules"].get(m, {})
            f, r, b = row.get("forward", 0), row.get("recompute", 0), row.get("backward", 0)
            totals[t] = [totals[t][0] + f, totals[t][1] + r, totals[t][2] + b]
            line += f"{f:>6} /{r:>4} /{b:>4} ={f + r + b:>5}"
        print(line)
    line = "total".ljust(28)
    for t in tools:
        f, r, b = totals[t]
        line += f"{f:>6} /{r:>4} /{b:>4} ={f + r + b:>5}"
    print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-titan", action="store_true")
    p.add_argument("--json")
    p.add_argument("--ops", action="store_true", help="print each tool's ops by name")
    a = p.parse_args()
    tools = {"runner": runner_block}
    if not a.no_titan:
        tools["torchtitan"] = titan_block
    results = report(tools)
    print_table(results)
    if a.ops:
        print(
            json.dumps(
                {t: {k: r[k] for k in r if k != "modules"} for t, r in results.items()}, indent=1
            )
        )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
