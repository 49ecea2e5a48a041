"""On a CUDA GPU: what the planner prices without one, measured kernel by kernel.

    python benchmarks/gpu_kernels.py [--part all|norm|attention|matmul|float8]
        [--cluster h200] [--tokens 8192] [--repeats 10] [--warmup 3] [--json PATH]

Without a CUDA GPU torch can use it says so, with the cause, and exits 0 having run nothing.
Every figure is the median of ``--repeats`` synchronised calls after ``--warmup``.

- **norm**: the runner's RMSNorm (``models/norm_rope.RMSNormFunction``) forward + backward in
  bf16 at the block norms' widths (Llama-3 1B / Qwen3-30B 2,048, Llama-3 8B 4,096, and the
  per-head q/k norms over 128 channels, 32 heads a token), op by op (the CPU path) and as
  torch's fused kernels (``FUSED_NORM_DEVICES``, the GPU path): time, the gain, and the fused
  path's largest difference from the op-by-op one (output, input and weight gradients,
  relative to each one's largest magnitude).
- **attention**: ``scaled_dot_product_attention`` forward + backward, bf16, 32 query heads,
  8 key/value heads (``enable_gqa``, as the runner calls it), head dim 128, one sequence:
  causal on ``s`` tokens (a whole sequence, or the diagonal chunk of a context-parallel ring)
  and full ``s`` x ``s`` (a ring's off-diagonal chunk), ``s`` from 1k to 64k: the tokens
  context parallel gives a rank (8k-256k tokens over 1-8 ranks). Reported as the FLOPs the
  runner counts (every query against every key, backward twice forward: ``step_flops``) per
  second, as a share of the GPU's dense peak: the planner prices attention at peak x
  ``cluster.compute_efficiency``, so this share is what that product should be.
- **matmul**: the linears' GEMMs (forward, input gradient, weight gradient) of Llama-3 1B and
  8B at ``--tokens`` tokens in bf16, measured against the planner's price of the same shape
  (``planner/matmul_time``, the ``--cluster`` preset: held out, no constant chosen on them).
- **float8**: the same forward GEMMs as ``torch._scaled_mm`` (e4m3 operands, tensorwise and
  rowwise scales; the casts not included) against bf16: the matmul's own gain by size. Then
  one linear's forward + backward under ``torch.compile`` with torchao's float8 training
  (tensorwise, as ``precision=float8``; the casts and scales included) against bf16, for the
  1B and 8B FFN shapes: the gain a job can see.

``--json PATH`` writes every row. Exit code 0 when every part ran (or there is no GPU), 1
when one failed (the others still run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsdp_runner.distributed.hardware import cuda_available, cuda_unusable_cause  # noqa: E402
from hsdp_runner.models import norm_rope  # noqa: E402
from hsdp_runner.train.metrics import lookup_peak_tflops  # noqa: E402

# Llama-3 1B and 8B linears: (name, out_features, in_features).
LINEARS = {
    "llama3_1b": [("wq", 2048, 2048), ("wkv", 512, 2048), ("w13", 8192, 2048), ("w2", 2048, 8192)],
    "llama3_8b": [
        ("wq", 4096, 4096),
        ("wkv", 1024, 4096),
        ("w13", 14336, 4096),
        ("w2", 4096, 14336),
    ],
}


def timed(fn, repeats: int, warmup: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup``, each synchronised."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def norm_rows(args) -> list[dict]:
    """The runner's RMSNorm op by op and fused (module docstring)."""
    shapes = [("dim 2048", args.tokens, 2048), ("dim 4096", args.tokens, 4096)]
    shapes.append(("q/k norm, 32 heads x 128", args.tokens * 32, 128))
    rows = []
    for label, n, dim in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        weight = (1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)).bfloat16()
        grad = torch.randn(n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        results = {}
        for path in ("ops", "fused"):
            if path == "ops":
                norm_rope.FUSED_NORM_DEVICES.discard("cuda")
            else:
                norm_rope.FUSED_NORM_DEVICES.add("cuda")
            xi = x.detach().requires_grad_()
            wi = weight.detach().requires_grad_()

            def step(xi=xi, wi=wi, grad=grad):
                out = norm_rope.RMSNormFunction.apply(xi, wi, 1e-6)
                return out, torch.autograd.grad(out, (xi, wi), grad)

            out, (gx, gw) = step()
            results[path] = (timed(step, args.repeats, args.warmup), out, gx, gw)
        norm_rope.FUSED_NORM_DEVICES.add("cuda")
        ops, fused = results["ops"], results["fused"]
        rows.append(
            {
                "shape": label,
                "rows": n,
                "ops_ms": ops[0] * 1e3,
                "fused_ms": fused[0] * 1e3,
                "gain": ops[0] / fused[0],
                "rel_diff_out": _rel(fused[1], ops[1]),
                "rel_diff_grad_x": _rel(fused[2], ops[2]),
                "rel_diff_grad_w": _rel(fused[3], ops[3]),
            }
        )
        print(
            f"norm {label:>26}: op by op {ops[0] * 1e3:7.3f} ms, fused {fused[0] * 1e3:7.3f} ms "
            f"(x{ops[0] / fused[0]:.2f}); rel diff out {rows[-1]['rel_diff_out']:.1e} "
            f"grad x {rows[-1]['rel_diff_grad_x']:.1e} grad w {rows[-1]['rel_diff_grad_w']:.1e}",
            flush=True,
        )
    return rows


def attention_rows(args, peak: float | None) -> list[dict]:
    """SDPA forward + backward at context-parallel chunk shapes (module docstring)."""
    heads, kv_heads, head_dim = 32, 8, 128
    rows = []
    for causal in (True, False):
        for s in (1024, 2048, 4096, 8192, 16384, 32768, 65536):
            if not causal and s > 32768:
                continue
            q = torch.randn(1, heads, s, head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = (
                torch.randn(1, kv_heads, s, head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2)
            )
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            grad = torch.randn_like(q)

            def step(q=q, k=k, v=v, grad=grad, causal=causal):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                torch.autograd.grad(out, (q, k, v), grad)

            seconds = timed(step, max(3, args.repeats // 2), 2)
            counted = 3 * 4 * s * s * head_dim * heads  # runner's count: full square, bwd 2x fwd
            row = {
                "causal": causal,
                "tokens": s,
                "ms": seconds * 1e3,
                "counted_tflops": counted / seconds / 1e12,
            }
            row["share_of_peak"] = row["counted_tflops"] / peak if peak else None
            rows.append(row)
            share = f"{row['share_of_peak']:.3f}" if peak else "n/a"
            print(
                f"attention {'causal' if causal else 'full':>6} s={s:>6}: {seconds * 1e3:9.3f} ms, "
                f"counted {row['counted_tflops']:6.1f} TFLOP/s, share of peak {share}",
                flush=True,
            )
            del q, k, v, grad
    return rows


def _matmul_device(cluster_name: str):
    from hsdp_runner.config.compose import compose
    from hsdp_runner.config.schema import ClusterConfig
    from hsdp_runner.planner import matmul_time
    from hsdp_runner.planner.cluster import resolve

    cfg = compose([f"cluster={cluster_name}"], config_name="plan").cluster
    fields = {k: v for k, v in cfg.items() if k in ClusterConfig.__dataclass_fields__}
    cluster = resolve(ClusterConfig(**fields), "bfloat16")
    return matmul_time, matmul_time.device_of(cluster, 2, cluster.float8_peak_tflops)


def _gemms(tokens: int):
    """(model, linear, pass, m, n, k) of every linear's three GEMMs at ``tokens`` rows."""
    for model, linears in LINEARS.items():
        for name, out_f, in_f in linears:
            yield model, name, "forward", tokens, out_f, in_f
            yield model, name, "grad input", tokens, in_f, out_f
            yield model, name, "grad weight", out_f, in_f, tokens


def matmul_rows(args) -> list[dict]:
    """bf16 GEMMs against the planner's price (module docstring)."""
    matmul_time, device = _matmul_device(args.cluster)
    rows = []
    for model, name, kind, m, n, k in _gemms(args.tokens):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        seconds = timed(lambda a=a, b=b: a @ b, args.repeats, args.warmup)
        predicted = matmul_time.seconds(matmul_time.Gemm(m=m, n=n, k=k), device)
        rows.append(
            {
                "model": model,
                "linear": name,
                "gemm": kind,
                "m": m,
                "n": n,
                "k": k,
                "ms": seconds * 1e3,
                "tflops": 2 * m * n * k / seconds / 1e12,
                "predicted_ms": predicted * 1e3,
                "error": predicted / seconds - 1,
            }
        )
        print(
            f"matmul {model} {name:>4} {kind:>11} ({m}x{n}x{k}): {seconds * 1e3:7.3f} ms "
            f"{rows[-1]['tflops']:6.1f} TFLOP/s; planner {predicted * 1e3:7.3f} ms "
            f"({rows[-1]['error']:+.1%})",
            flush=True,
        )
    errors = sorted(abs(r["error"]) for r in rows)
    print(f"matmul: median |error| {statistics.median(errors):.1%} over {len(rows)} GEMMs")
    return rows


def float8_rows(args) -> list[dict]:
    """float8 GEMMs and compiled float8 linears against bf16 (module docstring)."""
    rows = []
    f8 = torch.float8_e4m3fn
    for model, name, kind, m, n, k in _gemms(args.tokens):
        if kind != "forward":
            continue
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16 = timed(lambda a=a, b=b: a @ b.t(), args.repeats, args.warmup)
        a8, b8 = a.to(f8), b.to(f8)
        one = torch.ones((), device="cuda")
        row_a = torch.ones(m, 1, device="cuda")
        row_b = torch.ones(1, n, device="cuda")
        tensorwise = timed(
            lambda a8=a8, b8=b8, one=one: torch._scaled_mm(
                a8, b8.t(), one, one, out_dtype=torch.bfloat16
            ),
            args.repeats,
            args.warmup,
        )
        rowwise = timed(
            lambda a8=a8, b8=b8, row_a=row_a, row_b=row_b: torch._scaled_mm(
                a8, b8.t(), row_a, row_b, out_dtype=torch.bfloat16
            ),
            args.repeats,
            args.warmup,
        )
        rows.append(
            {
                "what": "gemm",
                "model": model,
                "linear": name,
                "m": m,
                "n": n,
                "k": k,
                "bf16_ms": bf16 * 1e3,
                "tensorwise_gain": bf16 / tensorwise,
                "rowwise_gain": bf16 / rowwise,
            }
        )
        print(
            f"float8 gemm {model} {name:>4} ({m}x{n}x{k}): bf16 {bf16 * 1e3:7.3f} ms, "
            f"tensorwise x{bf16 / tensorwise:.2f}, rowwise x{bf16 / rowwise:.2f}",
            flush=True,
        )
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    for model in ("llama3_1b", "llama3_8b"):
        _, out_f, in_f = next(lin for lin in LINEARS[model] if lin[0] == "w13")
        x = torch.randn(args.tokens, in_f, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(args.tokens, out_f, device="cuda", dtype=torch.bfloat16)
        times = {}
        for kind in ("bf16", "float8"):
            layer = torch.nn.Sequential(torch.nn.Linear(in_f, out_f, bias=False)).cuda().bfloat16()
            if kind == "float8":
                convert_to_float8_training(layer, config=Float8LinearConfig())
            compiled = torch.compile(layer)
            xi = x.detach().requires_grad_()

            def step(compiled=compiled, xi=xi, layer=layer, grad=grad):
                out = compiled(xi)
                torch.autograd.grad(out, (xi, layer[0].weight), grad)

            times[kind] = timed(step, args.repeats, args.warmup)
        rows.append(
            {
                "what": "compiled linear fwd+bwd",
                "model": model,
                "linear": "w13",
                "tokens": args.tokens,
                "bf16_ms": times["bf16"] * 1e3,
                "float8_ms": times["float8"] * 1e3,
                "gain": times["bf16"] / times["float8"],
            }
        )
        print(
            f"float8 compiled linear {model} w13 ({args.tokens}x{out_f}x{in_f}) fwd+bwd: "
            f"bf16 {times['bf16'] * 1e3:.3f} ms, float8 {times['float8'] * 1e3:.3f} ms "
            f"(x{times['bf16'] / times['float8']:.2f})",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the parts (module docstring); 0 when all ran or there is no GPU, 1 on a failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", choices=["all", "norm", "attention", "matmul", "float8"], default="all"
    )
    parser.add_argument("--cluster", default="h200")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not cuda_available():
        print(f"no CUDA GPU torch can use ({cuda_unusable_cause()}): nothing measured")
        return 0
    name = torch.cuda.get_device_name(0)
    peak = lookup_peak_tflops(name, "bfloat16")
    print(f"{name}; torch {torch.__version__}, CUDA {torch.version.cuda}; bf16 peak {peak}")
    parts = ["norm", "attention", "matmul", "float8"] if args.part == "all" else [args.part]
    report = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda}
    failed = False
    for part in parts:
        try:
            if part == "attention":
                report[part] = attention_rows(args, peak)
            else:
                report[part] = globals()[f"{part}_rows"](args)
        except Exception:  # one part's failure is printed; the others still run
            failed = True
            report[part] = {"error": traceback.format_exc()}
            print(f"{part} failed:\n{traceback.format_exc()}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
