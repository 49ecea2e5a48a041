"""Float8 and torch.compile on one GPU: tokens/s and loss of each, and the float8 refusal check.

    python benchmarks/float8_gpu_check.py [--layers 4] [--steps 10] [--warmup 3] [--batch 2]
        [--variants "bf16,bf16+compile,float8 tensorwise+compile,float8 rowwise+compile"]

Trains a Llama 3.2 1B-shaped model (width 2048, 32 heads, 8 KV heads, FFN 8192, vocabulary
128,256, sequence 2,048) cut to ``--layers`` blocks, on synthetic tokens, in turn as
bf16 eager, bf16 + compile, float8 tensorwise + compile and float8 rowwise + compile, the way the
runner builds a one-GPU job (``distributed/parallelize.py``): the model on the meta device,
torchao's ``convert_to_float8_training`` through ``hsdp_runner.distributed.float8.convert`` (output
layer and unaligned linears stay bf16), each block compiled, FSDP2 ``fully_shard`` on a
one-rank mesh with bf16 compute and fp32 master weights, fused AdamW. Every variant starts
from the same weights and sees the same batches, so the losses are comparable. Printed: the
GPU and its compute capability, torch and torchao versions, then per variant tokens/s (steps
after ``--warmup``), the first step's seconds (compilation), peak memory, the loss after the
last step and its difference from bf16 eager; then the refusal check: this GPU is allowed
float8 exactly when its capability is >= 8.9, and a simulated 8.0 GPU is refused.

Imports torch, torchao, and from this package only ``hsdp_runner.models.llama`` and
``hsdp_runner.distributed.float8`` (no Hydra, OmegaConf or W&B). The model files import one
name from OmegaConf, its ``MISSING`` sentinel ("???"); where omegaconf is not installed a
stand-in module holding that sentinel is registered first. Exit code 0 when every variant
trained and the refusal check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if importlib.util.find_spec("omegaconf") is None:
    sys.modules["omegaconf"] = types.ModuleType("omegaconf")
    sys.modules["omegaconf"].MISSING = "???"  # omegaconf.MISSING's value

from hsdp_runner.core.choices import DPMode  # noqa: E402
from hsdp_runner.core.errors import ConfigError  # noqa: E402
from hsdp_runner.distributed import float8  # noqa: E402
from hsdp_runner.models.llama import LlamaConfig  # noqa: E402

SEED = 0
DEVICE = "cuda"  # tests of this script on a CPU set "cpu"
# (name, precision.float8 recipe, compile)
VARIANTS = (
    ("bf16", "none", False),
    ("bf16+compile", "none", True),
    ("float8 tensorwise+compile", "tensorwise", True),
    ("float8 rowwise+compile", "rowwise", True),
)


def model_config(layers: int, seq_len: int) -> LlamaConfig:
    """conf/model/llama3_1b.yaml's shape with ``layers`` blocks."""
    return LlamaConfig(
        _target_="hsdp_runner.models.llama.LlamaConfig",
        name=f"llama3_1b_{layers}l",
        dim=2048,
        n_layers=layers,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=8192,
        seq_len=seq_len,
        rope_theta=500000.0,
    )


def build(cfg: LlamaConfig, recipe: str, compile_blocks: bool, mesh) -> torch.nn.Module:
    """The model as the runner builds a one-GPU job of ``precision=float8`` (``recipe``) or bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = cfg.build()
    precision = types.SimpleNamespace(float8=recipe, float8_all_gather=False)
    converted = float8.convert(model, precision, torch.device(DEVICE), DPMode.none, cfg.vocab_size)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks().values():
        if compile_blocks:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    model.to_empty(device=DEVICE)
    model.init_weights(SEED)
    model.converted = converted
    return model


def batch(step: int, rows: int, cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s synthetic tokens (the same for every variant): inputs and targets."""
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), device=DEVICE, generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def train(cfg: LlamaConfig, recipe: str, compile_blocks: bool, args, mesh) -> dict:
    """Train one variant; return its tokens/s, first-step seconds, peak GiB and losses."""
    torch._dynamo.reset()
    torch.cuda.reset_peak_memory_stats()
    model = build(cfg, recipe, compile_blocks, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        x, y = batch(step, args.batch, cfg)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises
        times.append(time.perf_counter() - start)
    timed = times[args.warmup :]
    result = {
        "tps": args.batch * cfg.seq_len * len(timed) / sum(timed),
        "first_step_s": times[0],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
        "float8_linears": len(model.converted),
    }
    del model, opt
    torch.cuda.empty_cache()
    return result


def refusal_check() -> bool:
    """This GPU passes ``float8.check_device`` iff its capability is >= 8.9; a simulated
    A100 (8.0) is refused. Prints what happened; returns True when both behave."""
    precision = types.SimpleNamespace(float8="tensorwise", float8_all_gather=True)
    capability = torch.cuda.get_device_capability(0)
    try:
        float8.check_device(precision, 1)
        allowed = True
    except ConfigError as err:
        allowed = False
        print(f"  this GPU refused: {err}")
    expected = capability >= float8.MIN_CAPABILITY
    print(f"  this GPU ({capability[0]}.{capability[1]}): allowed={allowed} (expected {expected})")
    try:
        float8.check_device(precision, 1, capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
        simulated = False
    except ConfigError as err:
        simulated = True
        print(f"  simulated 8.0 GPU refused: {str(err)[:110]}...")
    return allowed == expected and simulated


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--variants",
        default=",".join(name for name, _, _ in VARIANTS),
        help="comma-separated subset of: " + ", ".join(name for name, _, _ in VARIANTS),
    )
    args = parser.parse_args()
    chosen = [v.strip() for v in args.variants.split(",")]
    unknown = set(chosen) - {name for name, _, _ in VARIANTS}
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(sorted(unknown))}")
    if not torch.cuda.is_available():
        print("no usable GPU: torch.cuda.is_available() is False")
        return 1
    import torchao
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    cap = torch.cuda.get_device_capability(0)
    print(
        f"GPU {torch.cuda.get_device_name(0)}, compute capability {cap[0]}.{cap[1]}; torch "
        f"{torch.__version__}, torchao {torchao.__version__}"
    )
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cuda", (1,))
    cfg = model_config(args.layers, args.seq_len)
    print(
        f"model: llama3_1b shape, {args.layers} blocks, seq {cfg.seq_len}, batch {args.batch}; "
        f"{args.warmup} warmup + {args.steps} timed steps per variant\n"
    )
    ok, results, started = True, {}, time.perf_counter()
    for name, recipe, compile_blocks in VARIANTS:
        if name not in chosen:
            continue
        if recipe != "none" and cap < float8.MIN_CAPABILITY:
            print(f"{name}: skipped, this GPU has no float8 tensor cores")
            continue
        try:
            results[name] = train(cfg, recipe, compile_blocks, args, mesh)
        except Exception as err:  # report every variant, then fail
            ok = False
            print(f"{name}: FAILED: {type(err).__name__}: {str(err)[:400]}")
    base = results.get("bf16")
    print(
        "\n| variant | float8 linears | tokens/s | first step (s) | peak GiB | loss after "
        f"{args.warmup + args.steps} steps | vs bf16 |\n|---|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        last = r["losses"][-1]
        rel = "" if base is None else f"{last / base['losses'][-1] - 1:+.2%}"
        finite = all(math.isfinite(v) for v in r["losses"])
        ok = ok and finite
        print(
            f"| {name} | {r['float8_linears']} | {r['tps']:,.0f} | {r['first_step_s']:.1f} | "
            f"{r['peak_gib']:.1f} | {last:.4f}{'' if finite else ' (non-finite)'} | {rel} |"
        )
    print("\nrefusal check:")
    refused_right = refusal_check()
    print(f"  {'passed' if refused_right else 'FAILED'}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    dist.destroy_process_group()
    return 0 if ok and refused_right else 1


if __name__ == "__main__":
    sys.exit(main())
