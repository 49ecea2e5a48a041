"""The matmuls one rank runs in one optimizer step, with their shapes, read off the model.

``planner/matmul_time.py`` prices them; ``planner/precision_cost.py`` adds attention and the
work between matmuls. A GEMM is (M, N, K): an (M, K) operand times a (K, N) one.

- **Linears.** Every ``nn.Linear`` of the meta model, weight (out, in), on R rows (tokens):
  forward y = x W^T is (R, out, in); backward runs two GEMMs, the input's gradient
  dx = dy W, (R, in, out), and the weight's, dW = dy^T x, (out, in, R): its output is the
  weight, its reduction runs over the tokens. Under TP the dim ``ModelSpec.tp_split_dim`` names
  is divided by tp (column-parallel: out, row-parallel: in).
- **Rows.** R = the rank's tokens of one micro-batch: global batch x seq_len / (dp x cp x
  grad_accum_steps) for a linear outside the experts' layers (its TP ranks all see the tokens
  of their data and context slice; sequence parallel gathers them before a column-parallel
  linear), that / tp inside a mixture-of-experts layer (``models.base.moe_layers``: it runs on
  the rank's sequence shard with whole weights: router gate and shared experts).
- **Experts.** Each stacked expert weight of a MoE layer (a 3-D parameter, (E, out, in)) runs
  as one grouped GEMM over the G = E / ep experts the rank holds, on the rank's routed token
  copies R/tp x top_k (under ep the copies it receives, x ``plan.expert_imbalance``: the
  busiest rank) spread evenly over them: M_g rows each; forward G x (M_g, out, in), backward
  G x (M_g, in, out) and G x (out, in, M_g). With ``model.grouped_mm=false`` the experts run
  one after another: G launches of one group each. Under a chunked token exchange
  (``expert_parallel.exchange_chunks``: C chunks) each chunk runs its own: C launches on
  M_g / C rows.
- **Steps.** Each runs once per micro-batch. Activation checkpointing runs the blocks' forward
  GEMMs once more (full), or a share of them: selective recomputes every other matmul of a
  block, ``ModelSpec.selective_recompute_flops_per_token`` of the blocks' forward matmul
  FLOPs, priced as that share of each of the blocks' forward GEMMs; ``moe`` runs the MoE
  layers' forward GEMMs (router, experts, shared experts) once more and no other.
- **Float8.** The linears ``precision.float8`` converts (``float8.high_precision_linears``
  keeps the output layer and misaligned ones in the compute dtype) run all three GEMMs (and
  their recompute) in float8, as torchao's recipes do; the routed experts stay in the compute
  dtype (``precision.float8_experts=false``, the default). Their float8 grouped matmul
  (``float8_experts=true``) is refused here: measured much slower than bf16 (docs/precision.md),
  and its casts are not modelled.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.choices import AC
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed import float8, float8_experts
from hsdp_runner.distributed.expert_parallel import exchange_chunks
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.models.base import block_prefix, build_meta_model, model_spec, moe_layers
from hsdp_runner.planner.matmul_time import Gemm

MATMUL, FLOAT8, EXPERTS = "matmul", "float8_matmul", "expert_matmul"  # compute parts


def check_plannable(cfg: RunConfig, gpus: int) -> None:
    """Raise ConfigError for what the planner must not offer: what a job of ``cfg`` on
    ``gpus`` GPUs a node (0: a CPU cluster) would refuse (``float8_experts.check_experts``), and what
    it does not price: the routed experts in float8 (``precision.float8_experts=true``),
    measured slower than bf16 with its casts unmodelled."""
    float8_experts.check_experts(cfg.precision, cfg.model, gpus=gpus, compile=cfg.parallel.compile)
    if float8_experts.converts_experts(cfg.precision, cfg.model):
        raise ConfigError(
            "precision.float8_experts=true is not priced: torchao's float8 grouped matmul ran "
            "the Qwen3-30B experts' forward + backward 5.2x slower than bf16 on an H200 (its "
            "casts, which the planner has no model of; docs/precision.md), so pricing its "
            "matmuls at the float8 peak would rank a slower layout first; plan with "
            "precision.float8_experts=false"
        )


def _linear_gemms(rows: float, out: float, inn: float) -> list[tuple]:
    """(m, n, k) of a linear's forward, input-gradient and weight-gradient GEMMs."""
    return [(rows, out, inn), (rows, inn, out), (out, inn, rows)]


def _local(spec, fqn: str, shape, tp: int, sequence_parallel: bool) -> list[float]:
    """The (out, in) of weight ``fqn`` that one TP rank holds."""
    local = list(shape)
    split = spec.tp_split_dim(f"{fqn}.weight", sequence_parallel)
    if split is not None:
        local[split] = local[split] / tp
    return local


def _moe_prefixes(model: nn.Module) -> dict[str, nn.Module]:
    """{'<name>.': layer} of the model's mixture-of-experts layers."""
    layers = {id(layer) for layer in moe_layers(model)}
    return {f"{name}.": m for name, m in model.named_modules() if id(m) in layers}


def recompute_share(cfg: RunConfig, in_moe: bool = False) -> float:
    """How many times over activation checkpointing runs the blocks' forward GEMMs again in
    one step (``in_moe``: those inside the MoE layers): 0 without AC or with ``moe_act``, 1
    with full, with ``moe`` 1 inside the MoE layers and 0 outside, and with selective the
    share of the blocks' forward matmul FLOPs its policy recomputes
    (``ModelSpec.selective_recompute_flops_per_token``)."""
    ac = AC(cfg.parallel.ac)
    if ac in (AC.none, AC.moe_act):  # moe_act recomputes elementwise ops, no matmul
        return 0.0
    if ac is AC.moe:
        return 1.0 if in_moe else 0.0
    if ac is AC.full:
        return 1.0
    model = build_meta_model(cfg.model)
    blocks = block_prefix(model) + "."
    per_token = 0.0
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and fqn.startswith(blocks):
            per_token += module.weight.numel()
    for layer in moe_layers(model):
        for weight in layer.parameters():
            if weight.dim() == 3:
                per_token += weight.numel() / weight.shape[0] * layer.top_k
    return model_spec(cfg.model).selective_recompute_flops_per_token() / (2.0 * per_token)


def step_gemms(cfg: RunConfig, dims: ParallelDims, imbalance: float | None = None) -> list[Gemm]:
    """The GEMMs one rank of layout ``dims`` runs in one step of ``cfg`` (module docstring),
    identical ones merged (``Gemm.runs`` adds up); ``imbalance`` replaces
    ``plan.expert_imbalance`` (1.0: balanced routing)."""
    micro = cfg.trainer.grad_accum_steps
    rows = cfg.trainer.global_batch_size * cfg.model.seq_len / (dims.dp * dims.cp * micro)
    runs: Counter = Counter()
    _linears(runs, cfg, dims, rows)
    load = cfg.plan.expert_imbalance if imbalance is None else imbalance
    _experts(runs, cfg, dims, rows / dims.tp, load if dims.ep > 1 else 1.0)
    return [Gemm(m, n, k, g, count, part, f8) for (m, n, k, g, part, f8), count in runs.items()]


def _linears(runs: Counter, cfg: RunConfig, dims: ParallelDims, rows: float) -> None:
    """Add to ``runs`` ({(m, n, k, groups, part, float8): launches}) every linear's GEMMs, on
    ``rows`` tokens a micro-batch (a MoE layer's on its 1/tp sequence shard)."""
    model, spec, sp = (
        build_meta_model(cfg.model),
        model_spec(cfg.model),
        cfg.parallel.sequence_parallel,
    )
    micro = cfg.trainer.grad_accum_steps
    again_in = {in_moe: recompute_share(cfg, in_moe) for in_moe in (False, True)}
    blocks, moe = block_prefix(model) + ".", _moe_prefixes(model)
    converted = set()
    if float8.enabled(cfg.precision):
        kept = float8.high_precision_linears(cfg.model, dims.tp, sp)
        converted = {f for f, m in model.named_modules() if isinstance(m, nn.Linear)} - set(kept)
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        in_moe = any(fqn.startswith(prefix) for prefix in moe)
        out, inn = _local(spec, fqn, module.weight.shape, dims.tp, sp)
        f8 = fqn in converted
        key = (1, FLOAT8 if f8 else MATMUL, f8)
        gemms = _linear_gemms(rows / dims.tp if in_moe else rows, out, inn)
        for shape in gemms:
            runs[(*shape, *key)] += micro
        again = again_in[in_moe]
        if again and fqn.startswith(blocks):
            runs[(*gemms[0], *key)] += micro * again


def _experts(runs: Counter, cfg: RunConfig, dims: ParallelDims, rows: float, load: float) -> None:
    """Add to ``runs`` the experts' grouped GEMMs of every MoE layer: the layer's ``rows``
    tokens a micro-batch, top_k copies each, x ``load`` on this rank, over its local experts."""
    model, micro, again = (
        build_meta_model(cfg.model),
        cfg.trainer.grad_accum_steps,
        recompute_share(cfg, in_moe=True),
    )
    chunks = exchange_chunks(cfg.parallel, dims)
    for layer in moe_layers(model):
        copies = rows * layer.top_k * load
        for name, weight in layer.named_parameters():
            if weight.dim() != 3:
                continue
            experts, out, inn = weight.shape
            local = experts // dims.ep
            owner = layer.get_submodule(name.rpartition(".")[0])
            groups, launches = (local, 1) if getattr(owner, "grouped_mm", True) else (1, local)
            # In chunks (the flat token exchange's): each chunk's grouped GEMMs on its rows.
            launches *= chunks
            gemms = _linear_gemms(copies / local / chunks, out, inn)
            for shape in gemms:
                runs[(*shape, groups, EXPERTS, False)] += micro * launches
            if again:
                runs[(*gemms[0], groups, EXPERTS, False)] += micro * launches * again
