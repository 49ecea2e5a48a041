"""What the shared dense layers (``models/common.py``: RMSNorm, the q/k norms, RoPE) keep for
backward per token, and what a whole block costs as the planner measures it.

    python benchmarks/norm_rope_cost.py [--model llama3_8b qwen3_30b_a3b] [--precision bf16]
        [--seq 4096] [--world 8] [--ep EP] [--main PATH]

- **Per layer**: each layer of one block at the model's widths (``attention_norm`` and
  ``ffn_norm`` over ``dim``; ``q_norm`` / ``k_norm`` over each head's channels of q and k
  where the model has them; RoPE on q and on k), run on a few real CPU tokens in the
  precision's compute dtype under ``saved_tensors_hooks``: the bytes of every storage autograd
  keeps, once each (the layer's input too where it keeps it), its weight and the RoPE tables
  aside (they are not activations), per token, and how much of it is fp32.
- **Per block**: the planner's memory child (``planner/memory.py``, FSDP over ``--world``
  ranks, one ``--seq``-token sequence, no AC) at one and at two blocks, the growth of the
  activations at the end of forward per token; and ``traffic.traffic`` (the work
  between matmuls, eager and compiled) per token and block. A model with experts is measured
  with all blocks MoE (``model.n_dense_layers=0``), expert parallel over ``--ep`` ranks
  (default: the world): an MoE block's figures, the experts' layer included.

``--main PATH`` measures with the package at PATH instead (another checkout, for a
before/after table). Measurements are cached in a temporary directory (none is reused).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

if "--main" in sys.argv:
    sys.path.insert(0, sys.argv[sys.argv.index("--main") + 1])
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from hsdp_runner import plan  # noqa: E402
from hsdp_runner.config.compose import to_run_config  # noqa: E402
from hsdp_runner.distributed.hardware import CACHE_ENV  # noqa: E402
from hsdp_runner.models import norm_rope  # noqa: E402
from hsdp_runner.models.params import torch_dtype  # noqa: E402
from hsdp_runner.planner import memory, traffic  # noqa: E402


def saved_bytes(fn, x: torch.Tensor, skip: list[torch.Tensor]) -> tuple[int, int]:
    """(all, fp32) bytes of the storages autograd keeps for backward while ``fn(x)`` runs,
    each once, those of ``skip`` (weights, tables) aside; backward runs once on them."""
    ignore = {t.untyped_storage().data_ptr() for t in skip}
    kept = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in ignore:
            kept[ptr] = (t.untyped_storage().nbytes(), t.dtype == torch.float32)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = fn(x)
    out.float().sum().backward()
    return sum(n for n, _ in kept.values()), sum(n for n, fp32 in kept.values() if fp32)


def layer_figures(model_cfg, dtype: torch.dtype, tokens: int = 16) -> dict[str, float]:
    """{layer: (saved bytes, of which fp32) per token} of one block of ``model_cfg`` in
    ``dtype``."""
    dim = model_cfg.dim
    head_dim = getattr(model_cfg, "head_dim", None) or dim // model_cfg.n_heads
    heads, kv_heads = model_cfg.n_heads, model_cfg.n_kv_heads or model_cfg.n_heads
    cos, sin = norm_rope.rope_tables(head_dim, tokens, model_cfg.rope_theta)
    out = {}

    def norm_bytes(width: int, shape: tuple) -> tuple[float, float]:
        norm = norm_rope.RMSNorm(width, model_cfg.norm_eps).to(dtype)
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        return tuple(n / tokens for n in saved_bytes(norm, x, [norm.weight]))

    def rope_bytes(n: int) -> tuple[float, float]:
        x = torch.randn(1, tokens, n, head_dim, dtype=dtype, requires_grad=True)
        rope = lambda t: norm_rope.apply_rope(t, cos, sin)  # noqa: E731
        return tuple(n / tokens for n in saved_bytes(rope, x, [cos, sin]))

    def add(a: tuple, b: tuple) -> tuple:
        return tuple(i + j for i, j in zip(a, b))

    both = norm_bytes(dim, (1, tokens, dim))
    out["attention_norm + ffn_norm"] = add(both, both)
    if getattr(model_cfg, "qk_norm", False):
        out["q_norm"] = norm_bytes(head_dim, (1, tokens, heads, head_dim))
        out["k_norm"] = norm_bytes(head_dim, (1, tokens, kv_heads, head_dim))
    out["rope (q and k)"] = add(rope_bytes(heads), rope_bytes(kv_heads))
    return out


def block_figures(model: str, precision: str, seq: int, world: int, ep: int | None = None) -> dict:
    """{'act': saved activation bytes, 'forward'/'backward': eager traffic bytes,
    'forward_compiled'/'backward_compiled'}, each per token and block of ``model`` (its
    experts, if any, over ``ep`` ranks, default ``world``), and 'layers': ``layer_figures``."""
    cfg = plan.compose(
        [f"model={model}", f"precision={precision}", f"model.seq_len={seq}"]
        + [f"cluster.gpus_per_node={world}"]
    )
    typed = to_run_config(cfg)
    experts = hasattr(typed.model, "n_experts")
    if experts:
        cfg = plan.compose(
            [f"model={model}", f"precision={precision}", f"model.seq_len={seq}"]
            + ["model.n_dense_layers=0", f"cluster.gpus_per_node={world}"]
        )
        typed = to_run_config(cfg)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    requests = [
        memory.request(
            plain["model"],
            plain["parallel"],
            plain["precision"],
            [],
            (1, world, 1, 1),
            1,
            1,
            world,
            world,
            (0, blocks) if experts else blocks,
            accum_reduce="every",
            experts={"ep": ep or world, "imbalance": 1.0} if experts else None,
        )
        for blocks in (1, 2)
    ]
    one, two = (r["marks"]["0/end_fw"] for r in memory.measure(requests, use_disk_cache=False))
    out = {"act": (two["act"] - one["act"]) / seq}
    n = typed.model.n_layers
    for suffix, compiled in (("", False), ("_compiled", True)):
        t = traffic.traffic(typed.model, typed.precision, compiled)
        out[f"forward{suffix}"] = t.block_forward[0] / n
        out[f"backward{suffix}"] = t.block_backward[0] / n
    out["layers"] = layer_figures(typed.model, torch_dtype(typed.precision.param_dtype))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the figures of each model (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["llama3_8b", "qwen3_30b_a3b"])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--ep", type=int, help="a model with experts: ep degree (default: world)")
    parser.add_argument("--main", help="measure the package at this path instead")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        os.environ[CACHE_ENV] = cache
        try:
            for model in args.model:
                f = block_figures(model, args.precision, args.seq, args.world, args.ep)
                print(f"{model}, {args.precision}, per token and block (FSDP {args.world}):")
                for layer, (size, fp32) in f["layers"].items():
                    print(f"  {layer}: saves {size:,.0f} bytes, {fp32:,.0f} of them fp32")
                print(f"  block, planner's saved activations: {f['act']:,.0f} bytes")
                for suffix, name in (("", "eager"), ("_compiled", "compiled")):
                    fwd, bwd = f[f"forward{suffix}"], f[f"backward{suffix}"]
                    print(
                        f"  block traffic, {name}: forward {fwd / 1e6:.3f} MB + backward "
                        f"{bwd / 1e6:.3f} MB = {(fwd + bwd) / 1e6:.3f} MB"
                    )
        finally:
            memory.release_children()
    return 0


if __name__ == "__main__":
    sys.exit(main())
