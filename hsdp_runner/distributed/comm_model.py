"""Analytic communication per training step, from the model shape, the layout and the dtypes.

What one rank sends through collectives in one optimizer step, counted like ``comm.py`` counts
what it measures (the full tensor of each collective: gathered output, reduce-scatter input,
all-reduce tensor), keyed ``'<kind>/<mesh dim>'``. Collectives over groups of one rank move
nothing and are in neither. The model follows what the runner builds (``sharding.py``):

- FSDP (``dp_shard x cp`` > 1: it shards over ``dp_shard_cp``, reported under the name of the
  group's first dim, ``ParallelDims.same_group``): one all-gather per FSDP unit (each block,
  then the root: embedding,
  final norm, output) in every micro-batch's forward, in ``precision.param_dtype``; with
  ``reshard_after_forward`` the blocks are gathered again in backward (the root is never
  resharded after forward, see ``sharding.apply_data_parallel``); one reduce-scatter per unit
  of the trainable gradients in ``precision.reduce_dtype`` in every micro-batch with
  ``trainer.accum_reduce=every``, in the last one alone with ``last``
  (``grad_reductions``, ``sharding.set_gradient_sync``). FSDP pads each parameter's dim 0 to a
  multiple of the shard degree; the model pads the same way.
- Float8 all-gather (``precision.float8_all_gather`` under FSDP/HSDP, ``float8.gathers_float8``):
  the weights of the float8 linears (``float8_weight_sizes``) are gathered at one byte per
  element, the other parameters as above; after each optimizer step torchao's scale
  precompute all-reduces one amax per float8 weight (master dtype) over the shard group.
  Float8 TP (torchao's float8 styles move some activations in float8) is not modelled.
- HSDP adds one all-reduce per unit of the reduce-scattered gradient shard over
  ``dp_replicate``, once a step (after the last micro-batch, whatever ``accum_reduce``); DDP
  (``dp_shard x cp`` = 1) is that all-reduce of the whole gradients, also once.
- Context parallel (``context_parallel.SequenceShard``): per block and micro-batch one
  all-gather over ``cp`` of the rank's keys and values (2 x its tokens x the model's K/V width,
  ``ModelSpec.kv_dim``, in the compute dtype; gathered: the whole sequence's) in forward, and
  its autograd mirror, a reduce-scatter of their gradients, in backward. ``parallel.ac=full``
  recomputes the all-gather in backward; ``selective`` saves its output.
- TP (the model's Megatron plan, e.g. ``models/llama.py``) moves activations of the rank's
  tokens ``n = global_batch / dp x seq_len / cp`` in the compute dtype. With sequence
  parallel, per block an all-gather before attention and before the FFN and a reduce-scatter after each (and
  their mirror images in backward), the embedding's reduce-scatter (all-gather in backward),
  the output layer's input all-gather (reduce-scatter in backward), the logits' all-gather
  (n x vocab; its backward is a local slice) or, with ``parallel.loss_parallel`` (the default),
  instead of it the loss's three all-reduces of n fp32 each on the vocabulary-sharded logits
  (row max, sum of exponentials, target logit; ``train/loss.py``; its backward is local), and
  the all-reduce of the sequence-parallel norm
  parameters' gradients (``ModelSpec.tp_partial_grad_numels``; once per reduction of the
  gradients, ``grad_reductions``, when FSDP reduces them). Without sequence parallel
  those become all-reduces of the same tensors.
  With ``parallel.ac=full`` backward recomputes each block's forward, its TP collectives
  included, up to the last op whose output backward needs (torch's checkpoint stops early):
  per block the 2 all-gathers and the attention output's reduce-scatter with sequence
  parallel, the attention output's all-reduce without; the FFN output's reduce is the block's
  output, which backward never needs. ``selective`` saves their outputs (``sharding.apply_ac``)
  and repeats none.
- Pipeline parallel: everything above is counted per stage the rank holds (its blocks, the
  embedding on the first stage, the output layer and logits on the last; ``unit_sizes`` with
  ``stage``), over ``pp_microbatches`` micro-batches of ``global_batch / dp / m`` rows. Per
  micro-batch, each of the rank's stages but the last sends its output hidden state (rows x
  seq_len / cp x dim in the compute dtype, / tp when sequence parallel leaves it
  sequence-sharded) to the next stage, and each but the first sends the gradient of its input
  (the same size) back. torch's schedules reduce FSDP's gradients once a step, after the last
  micro-batch (``PipelineStage.perform_reduce_grad``, whatever ``trainer.accum_reduce``; the
  norms' TP partial gradients with them), and keep the parameters gathered after each
  micro-batch's backward: a block resharded after forward is gathered 1 + m times a step, the
  root once (``fsdp_gathers``). TP and CP collectives run per micro-batch. The grad
  norm's squares are summed over ``pp`` (one fp32). The first step also runs torch's runtime
  shape inference (metadata sends and a forward that gathers FSDP's units once more), so a
  pipeline job counts a later one (``metrics.comm_step=1``, the default, counts step 2 there). The zero-bubble schedule's split backward (input, then weights)
  gathers and reduces as the others do: measured so with FSDP inside the stages.
- The trainer's own all-reduce over all ranks: loss sum, non-finite flag and stop request in
  one small fp32 vector (``step_stats.STATS_BYTES``).

Not modelled, so measured/analytic sits a hair above 1: the all-reduces of per-parameter
norms ``clip_grad_norm_`` issues over DTensor meshes (one fp32 per parameter, ~100 bytes a
step), and, with TP but no FSDP, the repeated all-reduces of the norm weights' partial
gradients (DTensor reduces a ``Partial`` gradient again in each of clip_grad_norm_ and AdamW's
ops that reads it: 3 x norms x dim x dtype more). Both are below 1% of a step's bytes for any
model: they scale with the number of norms, the rest with parameters and activations.
"""

from __future__ import annotations

import math
from collections import defaultdict

from torch import nn

from hsdp_runner.config.schema import ParallelConfig, PrecisionConfig, TrainerConfig
from hsdp_runner.core.choices import AC, AccumReduce
from hsdp_runner.distributed import float8
from hsdp_runner.distributed.comm_counting import GROUP_NAMES
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.distributed.step_stats import STATS_BYTES
from hsdp_runner.models.base import (
    ModelConfig,
    block_prefix,
    build_meta_model,
    model_spec,
)
from hsdp_runner.models.params import frozen_names, torch_dtype

# The loss on vocabulary-sharded logits reduces fp32 values (it runs on the fp32 logits).
LOSS_BYTES = 4


def _dtype_bytes(name: str) -> int:
    return torch_dtype(name).itemsize


def _local_params(model_cfg: ModelConfig, dims: ParallelDims, sequence_parallel: bool):
    """(FSDP unit, parameter name, elements on one rank before FSDP sharding) of every
    parameter: its TP part (``ModelSpec.tp_split_dim``), dim 0 padded to a multiple of
    ``dp_shard x cp`` as FSDP pads it. Units: '<blocks>.<i>' (e.g. 'layers.0') or 'root'."""
    spec, model = model_spec(model_cfg), build_meta_model(model_cfg)
    blocks = block_prefix(model) + "."
    for name, param in model.named_parameters():
        shape = list(param.shape)
        split = spec.tp_split_dim(name, sequence_parallel) if dims.tp > 1 else None
        if split is not None:
            shape[split] //= dims.tp
        shape[0] = math.ceil(shape[0] / dims.dp_shard_cp) * dims.dp_shard_cp
        unit = ".".join(name.split(".")[:2]) if name.startswith(blocks) else "root"
        yield unit, name, math.prod(shape)


def unit_sizes(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    freeze=(),
    sequence_parallel: bool = True,
    stage: int | None = None,
) -> dict[str, tuple[int, int]]:
    """Elements per FSDP unit ('<blocks>.<i>', e.g. 'layers.0', or 'root'): (all parameters,
    trainable ones).

    Sizes are one TP rank's part of each parameter (``ModelSpec.tp_split_dim``), dim 0 padded
    to a multiple of ``dp_shard x cp`` (the FSDP shard degree) as FSDP pads it. With
    ``stage`` (a pipeline stage index of ``dims.pp_stages``), only that stage's parameters
    (``models/base.keep_stage``); a stage without embeddings or output layer has no root unit.
    """
    model = build_meta_model(model_cfg)
    params = dict(model.named_parameters())
    blocks = block_prefix(model) + "."
    frozen = set(frozen_names(params, freeze))
    units: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for unit, name, numel in _local_params(model_cfg, dims, sequence_parallel):
        if stage is not None and not _on_stage(model, name, blocks, stage, dims):
            continue
        units[unit][0] += numel
        units[unit][1] += 0 if name in frozen else numel
    return {unit: (sizes[0], sizes[1]) for unit, sizes in units.items()}


def float8_weight_sizes(
    model_cfg: ModelConfig, dims: ParallelDims, sequence_parallel: bool = True
) -> dict[str, list[int]]:
    """Per FSDP unit (as ``unit_sizes``), the elements of each weight ``float8.convert`` turns
    into a float8 linear: what a float8 all-gather sends at one byte per element."""
    spec, model = model_spec(model_cfg), build_meta_model(model_cfg)
    modules = dict(model.named_modules())
    sizes: dict[str, list[int]] = defaultdict(list)
    for unit, name, numel in _local_params(model_cfg, dims, sequence_parallel):
        fqn, _, leaf = name.rpartition(".")
        module = modules.get(fqn)
        if leaf != "weight" or not isinstance(module, nn.Linear):
            continue
        if not float8.keeps_high_precision(
            fqn,
            tuple(module.weight.shape),
            model_cfg.vocab_size,
            dims.tp,
            lambda f: spec.tp_split_dim(f"{f}.weight", sequence_parallel),
        ):
            sizes[unit].append(numel)
    return dict(sizes)


def _on_stage(model, name: str, blocks: str, stage: int, dims: ParallelDims) -> bool:
    """Whether parameter ``name`` of the unsplit ``model`` lives on pipeline ``stage``."""
    if name.startswith(blocks):
        block = int(name[len(blocks) :].split(".")[0])
        return block in dims.stage_blocks(len(model.blocks()))[stage]
    first, last = model.pipeline_ends()
    top = name.split(".")[0]
    return (stage == 0 and top in first) or (stage == dims.pp_stages - 1 and top in last)


class _Tally:
    def __init__(self):
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})

    def add(self, key: str, calls: int, nbytes: int) -> None:
        if calls and nbytes:
            self.counts[key]["calls"] += calls
            self.counts[key]["bytes"] += nbytes


def analytic_comm(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    trainer: TrainerConfig,
    pp_rank: int = 0,
    pipeline_stage: bool = False,
) -> dict[str, dict[str, int]]:
    """Return {'<kind>/<dim>': {'calls', 'bytes'}} one rank communicates in one step.

    Takes the ``model``, ``parallel``, ``precision`` and ``trainer`` config nodes, the job's
    ParallelDims and, under pipeline parallel, the rank's ``pp`` coordinate (its stages differ
    in what they send). ``pipeline_stage``: the job (pp = 1) is one stage of a pipeline, as the
    planner prices a stage, with ``trainer.grad_accum_steps`` its micro-batches: FSDP gathers
    and reduces as a stage does (``fsdp_gathers``), without the stage-to-stage sends. See the
    module docstring for what is counted.
    """
    tally = _Tally()
    if dims.pp > 1:
        _pipeline(tally, model_cfg, dims, parallel, precision, trainer, pp_rank)
        tally.add(f"all_reduce/{world_dim(dims)}", 1, STATS_BYTES)
        return {key: dict(tally.counts[key]) for key in sorted(tally.counts)}
    accum = trainer.grad_accum_steps
    units = unit_sizes(model_cfg, dims, trainer.freeze, parallel.sequence_parallel)
    f8 = (
        float8_weight_sizes(model_cfg, dims, parallel.sequence_parallel)
        if float8.gathers_float8(precision, dims.dp_mode)
        else {}
    )
    reductions = 1 if pipeline_stage else grad_reductions(dims, trainer)
    gathers = fsdp_gathers(accum, parallel.reshard_after_forward, pipeline_stage)
    _data_parallel(tally, units, f8, dims, precision, gathers, reductions)
    compute = _dtype_bytes(precision.param_dtype)
    if dims.cp > 1:
        _context_parallel(
            tally,
            model_cfg,
            dims,
            trainer.global_batch_size // dims.dp,
            compute,
            accum,
            parallel.ac == AC.full,
        )
    if dims.tp > 1:
        tokens = trainer.global_batch_size // dims.dp * model_cfg.seq_len // dims.cp
        _tensor_parallel(
            tally,
            model_cfg,
            tokens,
            parallel.sequence_parallel,
            compute,
            accum,
            parallel.ac == AC.full,
            reductions,
            loss_parallel=parallel.loss_parallel,
        )
    if dims.world_size > 1:
        tally.add(f"all_reduce/{world_dim(dims)}", 1, STATS_BYTES)
    return {key: dict(tally.counts[key]) for key in sorted(tally.counts)}


def grad_reductions(dims: ParallelDims, trainer: TrainerConfig) -> int:
    """How many times a step reduce-scatters the gradients over FSDP's group
    (``sharding.set_gradient_sync``): every micro-batch with ``trainer.accum_reduce=every``
    when they are sharded (``dp_shard x cp`` > 1), else once, on the last micro-batch. Whole
    replicas (DDP) and HSDP's replicate dim all-reduce once a step either way."""
    if dims.dp_shard_cp > 1 and AccumReduce(trainer.accum_reduce) is AccumReduce.every:
        return trainer.grad_accum_steps
    return 1


def _pipeline(
    tally: _Tally,
    model_cfg: ModelConfig,
    dims: ParallelDims,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    trainer: TrainerConfig,
    pp_rank: int,
) -> None:
    """What the rank at ``pp`` coordinate ``pp_rank`` sends in a step: for each of its stages
    the stage-to-stage sends and the collectives of the data, context and tensor parallel
    dims inside the stage, then the grad norm's all-reduce over ``pp`` (module docstring)."""
    m, compute = dims.pp_microbatches, _dtype_bytes(precision.param_dtype)
    rows = trainer.global_batch_size // dims.dp  # the rank's rows a step, over micro-batches
    tokens = rows * model_cfg.seq_len // dims.cp
    sharded = dims.tp > 1 and parallel.sequence_parallel  # stage outputs are sequence-sharded
    hidden = rows // m * model_cfg.seq_len // dims.cp * model_cfg.dim * compute
    hidden //= dims.tp if sharded else 1
    last = dims.pp_stages - 1
    blocks = dims.stage_blocks(model_cfg.n_layers)
    for stage in (pp_rank + i * dims.pp for i in range(dims.pp_stages_per_rank)):
        ends = (stage == 0, stage == last)
        sends = (not ends[1]) + (not ends[0])  # activations forward, gradients back
        tally.add("send/pp", sends * m, sends * m * hidden)
        units = unit_sizes(model_cfg, dims, trainer.freeze, parallel.sequence_parallel, stage)
        gathers = fsdp_gathers(m, parallel.reshard_after_forward, pipeline_stage=True)
        _data_parallel(tally, units, {}, dims, precision, gathers, reductions=1)
        layers = len(blocks[stage])
        if dims.cp > 1:
            _context_parallel(
                tally, model_cfg, dims, rows, compute, m, parallel.ac == AC.full, layers
            )
        if dims.tp > 1:
            _tensor_parallel(
                tally,
                model_cfg,
                tokens,
                parallel.sequence_parallel,
                compute,
                m,
                parallel.ac == AC.full,
                1,
                layers,
                ends,
                parallel.loss_parallel,
            )
    tally.add("all_reduce/pp", 1, 4)


def fsdp_gathers(micro_batches: int, reshard: bool, pipeline_stage: bool) -> tuple[int, int]:
    """How often a step all-gathers FSDP's parameters: (each unit in forward, each block in
    backward), over ``micro_batches`` micro-batches.

    With accumulation every micro-batch's forward gathers every unit (FSDP reshards after each
    backward), and its backward the blocks again when they are resharded after forward
    (``reshard``). A pipeline stage's schedule keeps the parameters gathered after each
    micro-batch's backward and reduces its gradients once, after the last one
    (``PipelineStage.backward_maybe_with_nosync`` and ``perform_reduce_grad``): a block
    resharded after forward is gathered again only by the action after a forward, so with
    every stage's actions ending in a backward, once per micro-batch in backward, plus the
    first forward's gather (1 + m a step, whatever the schedule's order); without resharding,
    and for the root (never resharded after forward), once a step.
    """
    backward = micro_batches if reshard else 0
    return (1 if pipeline_stage else micro_batches), backward


def world_dim(dims: ParallelDims) -> str:
    """The name ``comm.CommCounter`` gives the group of all ranks: the first mesh dim (or the
    flattened ``dp``) spanning every rank, else ``world``."""
    return next((name for name in GROUP_NAMES if dims.group_size(name) == dims.world_size), "world")


def context_parallel_comm(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    trainer: TrainerConfig,
) -> dict[str, dict[str, int]]:
    """Return the part of ``analytic_comm`` that is context parallel's key/value exchange
    ({'all_gather/cp', 'reduce_scatter/cp': {'calls', 'bytes'}}; empty when cp = 1). Same
    arguments as ``analytic_comm``. The planner prices it apart from FSDP's collectives, which
    share the 'cp' keys when dp_shard = 1."""
    tally = _Tally()
    if dims.cp > 1:
        _context_parallel(
            tally,
            model_cfg,
            dims,
            trainer.global_batch_size // dims.dp,
            _dtype_bytes(precision.param_dtype),
            trainer.grad_accum_steps,
            parallel.ac == AC.full,
        )
    return {key: dict(tally.counts[key]) for key in sorted(tally.counts)}


def _data_parallel(
    tally: _Tally,
    units: dict,
    float8_sizes: dict,
    dims: ParallelDims,
    precision: PrecisionConfig,
    gathers: tuple[int, int],
    reductions: int,
) -> None:
    """FSDP's all-gathers (``gathers``: ``fsdp_gathers``) and reduce-scatters (``reductions``
    a step), HSDP's and DDP's all-reduces; the elements of ``float8_sizes`` (per unit) are
    gathered at one byte each, and their scales are precomputed once a step (one fp32 amax per
    float8 weight, all-reduced over the shards)."""
    gather, reduce = _dtype_bytes(precision.param_dtype), _dtype_bytes(precision.reduce_dtype)
    trainable = {unit: sizes[1] for unit, sizes in units.items() if sizes[1]}
    if dims.dp_shard_cp > 1:
        shard_dim = dims.same_group("dp_shard_cp")

        def gathered(unit_names) -> int:
            f8 = sum(sum(float8_sizes.get(u, ())) for u in unit_names)
            return (sum(units[u][0] for u in unit_names) - f8) * gather + f8

        blocks = [unit for unit in units if unit != "root"]
        forward, backward = gathers
        tally.add(f"all_gather/{shard_dim}", len(units) * forward, gathered(units) * forward)
        tally.add(f"all_gather/{shard_dim}", len(blocks) * backward, gathered(blocks) * backward)
        tally.add(
            f"reduce_scatter/{shard_dim}",
            len(trainable) * reductions,
            sum(trainable.values()) * reduce * reductions,
        )
        if float8_sizes:
            weights = sum(len(sizes) for sizes in float8_sizes.values())
            tally.add(f"all_reduce/{shard_dim}", 1, weights * _dtype_bytes(precision.master_dtype))
    if dims.dp_replicate > 1:
        shard = sum(trainable.values()) // dims.dp_shard_cp
        tally.add("all_reduce/dp_replicate", len(trainable), shard * reduce)


def _context_parallel(
    tally: _Tally,
    model_cfg: ModelConfig,
    dims: ParallelDims,
    rows: int,
    compute: int,
    accum: int,
    recompute: bool,
    layers: int | None = None,
) -> None:
    """The K/V all-gather of every block (again under full AC) and its gradients'
    reduce-scatter, for ``rows`` sequences a step (over the micro-batches); ``layers``: the
    blocks counted (all by default, a pipeline stage's)."""
    layers = model_cfg.n_layers if layers is None else layers
    kv_width = model_spec(model_cfg).kv_dim() // dims.tp  # the rank's K/V heads under TP
    gathered = 2 * rows * model_cfg.seq_len * kv_width * compute  # keys and values, all S
    passes = 2 if recompute else 1
    tally.add(
        f"all_gather/{dims.same_group('cp')}", passes * layers * accum, passes * layers * gathered
    )
    tally.add(f"reduce_scatter/{dims.same_group('cp')}", layers * accum, layers * gathered)


def _tensor_parallel(
    tally: _Tally,
    model_cfg: ModelConfig,
    tokens: int,
    sequence_parallel: bool,
    compute: int,
    accum: int,
    recompute: bool = False,
    reductions: int = 1,
    layers: int | None = None,
    ends: tuple[bool, bool] = (True, True),
    loss_parallel: bool = False,
) -> None:
    """TP's activation collectives for ``tokens`` a step over ``accum`` passes, and the norms'
    partial gradients ``reductions`` times. ``layers`` (default all) and ``ends`` (whether the
    embedding and the output layer are held) restrict it to a pipeline stage;
    ``loss_parallel``: the loss runs on vocabulary-sharded logits (``train/loss.py``)."""
    all_layers, dim = model_cfg.n_layers, model_cfg.dim
    layers = all_layers if layers is None else layers
    first, last = ends
    act = tokens * dim * compute  # one residual-stream activation of the step's tokens on a rank
    if recompute:  # full AC: the blocks' forward collectives run again (module docstring)
        again = (
            {"all_gather/tp": 2, "reduce_scatter/tp": 1}
            if sequence_parallel
            else {"all_reduce/tp": 1}
        )
        for kind, per_block in again.items():
            tally.add(kind, per_block * layers * accum, per_block * layers * act)
    if last and loss_parallel:  # per token: the row max, the sum of exponentials, the target
        tally.add("all_reduce/tp", 3 * accum, 3 * tokens * LOSS_BYTES)
    elif last:
        tally.add("all_gather/tp", accum, tokens * model_cfg.vocab_size * compute)  # logits
    if sequence_parallel:
        # 2 per block in each pass, the output layer's input all-gather (forward) and the
        # embedding's (backward); the reduce-scatters mirror them
        calls = 4 * layers + first + last
        tally.add("all_gather/tp", calls * accum, calls * act)
        tally.add("reduce_scatter/tp", calls * accum, calls * act)
        # The partial gradients accumulate until they are first used: by each of FSDP's
        # reduce-scatters (``reductions`` a step), or by clip_grad_norm_ without FSDP (once).
        # Each norm's entries (weight, bias) come per norm: 2 a block and the final one.
        norms = model_spec(model_cfg).tp_partial_grad_numels()
        per_norm = len(norms) // (2 * all_layers + 1)
        held = per_norm * (2 * layers + last)
        numel = sum(norms[:held])
        tally.add("all_reduce/tp", held * reductions, numel * compute * reductions)
    else:
        calls = 4 * layers + first + last  # per block 2 in forward, 2 in backward; the ends
        tally.add("all_reduce/tp", calls * accum, calls * act)


def comm_report(measured: dict, analytic: dict, step: int) -> dict:
    """Summary facts: per-step totals, their ratio and both breakdowns, for one measured step."""
    total_m = sum(e["bytes"] for e in measured.values())
    total_a = sum(e["bytes"] for e in analytic.values())
    return {
        "comm_step": step,
        "comm_bytes_measured": total_m,
        "comm_bytes_analytic": total_a,
        "comm_ratio": total_m / total_a if total_a else None,
        "comm_measured": measured,
        "comm_analytic": analytic,
    }
