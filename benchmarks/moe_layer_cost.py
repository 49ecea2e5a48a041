"""What one MoE block costs per token beyond its matmuls, as the planner measures it.

    python benchmarks/moe_layer_cost.py [--model qwen3_30b_a3b] [--precision bf16]
        [--seq 4096] [--world 8] [--ep 8] [--main PATH]

- **Saved activations**: the planner's memory child (``planner/memory.py``: the job's own
  build on fake tensors, FSDP over ``--world`` ranks with ``--ep``, one sequence of ``--seq``
  tokens, no activation checkpointing) at one and at two MoE blocks; the growth of the
  tracker's activations at the end of forward, per token (``mem_phases``' per-block growth).
- **Memory traffic**: the work between matmuls the planner prices
  (``planner/precision_cost.py`` ``traffic``, traced from the model's own ops), per token and
  MoE block, forward and backward, eager and compiled.

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

from omegaconf import OmegaConf  # noqa: E402

from hsdp_runner import plan  # noqa: E402
from hsdp_runner.config.compose import to_run_config  # noqa: E402
from hsdp_runner.distributed.hardware import CACHE_ENV  # noqa: E402
from hsdp_runner.planner import memory, precision_cost  # noqa: E402


def figures(model: str, precision: str, seq: int, world: int, ep: int) -> dict:
    """{'act': saved activation bytes, 'forward'/'backward': eager traffic bytes,
    'forward_compiled'/'backward_compiled'}, each per token and MoE block of ``model`` (a
    preset whose blocks are all MoE: ``model.n_dense_layers=0`` is set)."""
    cfg = plan.compose(
        [f"model={model}", f"precision={precision}", f"model.seq_len={seq}"]
        + ["model.n_dense_layers=0", f"cluster.gpus_per_node={world}"]
    )
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
            (0, blocks),
            accum_reduce="every",
            experts={"ep": ep, "imbalance": 1.0},
        )
        for blocks in (1, 2)
    ]
    one, two = (r["marks"]["0/end_fw"] for r in memory.measure(requests, use_disk_cache=False))
    out = {"act": (two["act"] - one["act"]) / seq}
    typed = to_run_config(cfg)
    n = typed.model.n_layers
    for suffix, compiled in (("", False), ("_compiled", True)):
        t = precision_cost.traffic(typed.model, typed.precision, compiled)
        out[f"forward{suffix}"] = t.block_forward[0] / n
        out[f"backward{suffix}"] = t.block_backward[0] / n
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the figures of one model (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_30b_a3b")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--main", help="measure the package at this path instead")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        os.environ[CACHE_ENV] = cache
        try:
            f = figures(args.model, args.precision, args.seq, args.world, args.ep)
        finally:
            memory.release_children()
    print(
        f"{args.model}, {args.precision}, per token and MoE block (FSDP {args.world}, ep {args.ep}):"
    )
    print(f"  saved activations: {f['act']:,.0f} bytes ({f['act'] / 1024:.1f} KiB)")
    for suffix, name in (("", "eager"), ("_compiled", "compiled")):
        fwd, bwd = f[f"forward{suffix}"], f[f"backward{suffix}"]
        print(
            f"  traffic, {name}: forward {fwd / 1e6:.3f} MB + backward {bwd / 1e6:.3f} MB = "
            f"{(fwd + bwd) / 1e6:.3f} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
