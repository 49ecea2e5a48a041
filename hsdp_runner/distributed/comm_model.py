"""Analytic communication per training step, from the model shape, the layout and the dtypes.

What one rank sends through collectives in one optimizer step, counted like ``comm.py`` counts
what it measures (the full tensor of each collective: gathered output, reduce-scatter input,
all-reduce tensor), keyed ``'<kind>/<mesh dim>'``. Collectives over groups of one rank move
nothing and are in neither.

One counter, ``_stage``, counts what a rank of one pipeline stage sends in a step: its
stage-to-stage sends, the FSDP/HSDP/DDP collectives of the stage's parameters, and the context
and tensor parallel collectives of its blocks and ends. ``analytic_comm`` sums it over the
rank's stages and adds the step's reductions over all ranks. A job without pipeline parallel is
one stage holding both ends (embedding and output layer), with no sends; its micro-batches are
``trainer.grad_accum_steps``. How the stage's step passes (micro-batches, FSDP's gathers and
gradient reductions) is ``stage_passes``: the accumulation loop's, or a pipeline schedule's
(pp > 1, or a pp = 1 job the planner prices as one stage of a pipeline, ``pipeline_stage``).
The model follows what the runner builds (``sharding.py``):

- FSDP (``dp_shard x cp`` > 1: it shards over ``dp_shard_cp``, reported under the name of the
  group's first dim, ``ParallelDims.same_group``): one all-gather per FSDP unit (each block,
  then the root: embedding, final norm, output) in every micro-batch's forward, in
  ``precision.param_dtype``; with ``reshard_after_forward`` the blocks are gathered again in
  backward (the root is never resharded after forward, see ``sharding.apply_data_parallel``);
  one reduce-scatter per unit of the trainable gradients in ``precision.reduce_dtype`` in
  every micro-batch with ``trainer.accum_reduce=every``, in the last one alone with ``last``
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
- Pipeline parallel: each of the rank's stages (``_rank_stages``) is counted as above with
  its own parameters (its blocks, the embedding on the first stage, the output
  layer and logits on the last; ``unit_sizes`` and ``float8_weight_sizes`` with ``stage``),
  over ``pp_microbatches`` micro-batches of ``global_batch / dp / m`` rows. Per micro-batch,
  each stage but the last sends its output hidden state (``stage_send_bytes``: rows x
  seq_len / cp x dim in the compute dtype, / tp when sequence parallel leaves it
  sequence-sharded) to the next stage, and each but the first sends the gradient of its input
  (the same size) back. torch's schedules reduce FSDP's gradients once a step, after the last
  micro-batch (``PipelineStage.perform_reduce_grad``, whatever ``trainer.accum_reduce``; the
  norms' TP partial gradients with them), and keep the parameters gathered after each
  micro-batch's backward: a block resharded after forward is gathered 1 + m times a step, the
  root once (``fsdp_gathers``). TP and CP collectives run per micro-batch. Under float8
  all-gather each stage chunk gathers its float8 weights at one byte per element and
  precomputes their scales with one all-reduce of its own (``float8.after_update`` runs per
  chunk). The grad norm's squares are summed over ``pp`` (one fp32). The first step also runs
  torch's runtime shape inference (metadata sends and a forward that gathers FSDP's units
  once more), so a pipeline job counts a later one (``metrics.comm_step=1``, the default,
  counts step 2 there). The zero-bubble schedule's split backward (input, then weights)
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
from dataclasses import dataclass

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


def _local_params(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    sequence_parallel: bool,
    stage: int | None = None,
):
    """(FSDP unit, parameter name, elements on one rank before FSDP sharding) of every
    parameter: its TP part (``ModelSpec.tp_split_dim``), dim 0 padded to a multiple of
    ``dp_shard x cp`` as FSDP pads it. Units: '<blocks>.<i>' (e.g. 'layers.0') or 'root'.
    With ``stage`` (a pipeline stage index of ``dims.pp_stages``), only that stage's
    parameters (``_on_stage``)."""
    spec, model = model_spec(model_cfg), build_meta_model(model_cfg)
    blocks = block_prefix(model) + "."
    for name, param in model.named_parameters():
        if stage is not None and not _on_stage(model, name, blocks, stage, dims):
            continue
        shape = list(param.shape)
        split = spec.tp_split_dim(name, sequence_parallel) if dims.tp > 1 else None
        if split is not None:
            shape[split] //= dims.tp
        shape[0] = math.ceil(shape[0] / dims.dp_shard_cp) * dims.dp_shard_cp
        unit = ".".join(name.split(".")[:2]) if name.startswith(blocks) else "root"
        yield unit, name, math.prod(shape)


def _on_stage(model, name: str, blocks: str, stage: int, dims: ParallelDims) -> bool:
    """Whether parameter ``name`` of the unsplit ``model`` lives on pipeline ``stage``, as
    ``models/base.keep_stage`` cuts it: a block on its stage, the first modules on stage 0,
    the last on the last stage, anything else on every stage (so the one stage of a job
    without pipeline parallel holds every parameter)."""
    if name.startswith(blocks):
        block = int(name[len(blocks) :].split(".")[0])
        return block in dims.stage_blocks(len(model.blocks()))[stage]
    first, last = model.pipeline_ends()
    top = name.split(".")[0]
    if top in first:
        return stage == 0
    return stage == dims.pp_stages - 1 if top in last else True


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
    params = dict(build_meta_model(model_cfg).named_parameters())
    frozen = set(frozen_names(params, freeze))
    units: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for unit, name, numel in _local_params(model_cfg, dims, sequence_parallel, stage):
        units[unit][0] += numel
        units[unit][1] += 0 if name in frozen else numel
    return {unit: (sizes[0], sizes[1]) for unit, sizes in units.items()}


def float8_weight_sizes(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    sequence_parallel: bool = True,
    stage: int | None = None,
) -> dict[str, list[int]]:
    """Per FSDP unit (as ``unit_sizes``, ``stage`` too), the elements of each weight
    ``float8.convert`` turns into a float8 linear: what a float8 all-gather sends at one byte
    per element."""
    spec, model = model_spec(model_cfg), build_meta_model(model_cfg)
    modules = dict(model.named_modules())
    sizes: dict[str, list[int]] = defaultdict(list)
    for unit, name, numel in _local_params(model_cfg, dims, sequence_parallel, stage):
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


class _Tally:
    def __init__(self):
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})

    def add(self, key: str, calls: int, nbytes: int) -> None:
        if calls and nbytes:
            self.counts[key]["calls"] += calls
            self.counts[key]["bytes"] += nbytes

    def result(self) -> dict[str, dict[str, int]]:
        """{'<kind>/<dim>': {'calls', 'bytes'}}, sorted by key."""
        return {key: dict(self.counts[key]) for key in sorted(self.counts)}


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
    ParallelDims and, under pipeline parallel, the rank's ``pp`` coordinate. Sums the stage
    counter (``_stage``) over the rank's stages (``_rank_stages``; without pipeline
    parallel the one stage, holding both ends), then adds the step's all-ranks reductions.
    ``pipeline_stage``: the job (pp = 1) is one stage of a pipeline, as the planner prices a
    stage, with ``trainer.grad_accum_steps`` its micro-batches (``stage_passes``). See the
    module docstring for what is counted.
    """
    tally = _Tally()
    passes = stage_passes(dims, parallel, trainer, pipeline_stage)
    for stage in _rank_stages(pp_rank, dims):
        _stage(tally, model_cfg, dims, parallel, precision, trainer, stage, passes)
    if dims.pp > 1:
        tally.add("all_reduce/pp", 1, 4)  # the grad norm's squares, summed over the stages
    if dims.world_size > 1:
        tally.add(f"all_reduce/{world_dim(dims)}", 1, STATS_BYTES)
    return tally.result()


def _rank_stages(pp_rank: int, dims: ParallelDims) -> range:
    """The stages rank ``pp_rank`` of the ``pp`` dim holds: r, r + pp, ... (the loop
    placement ``pipeline.local_stages`` builds; that module is not imported here, it reaches
    the sharding applier). Without pipeline parallel: stage 0 alone."""
    return range(pp_rank, dims.pp_stages, dims.pp)


@dataclass(frozen=True)
class StagePasses:
    """How a stage runs its step: ``micro_batches`` forward and backward passes, FSDP's
    all-gathers ``gathers`` (``fsdp_gathers``: of each unit in forward, of each block in
    backward) and its gradient reductions ``reductions`` a step (``grad_reductions``)."""

    micro_batches: int
    gathers: tuple[int, int]
    reductions: int


def stage_passes(
    dims: ParallelDims,
    parallel: ParallelConfig,
    trainer: TrainerConfig,
    pipeline_stage: bool = False,
) -> StagePasses:
    """The passes of every stage of layout ``dims`` (``parallel``, ``trainer`` config nodes).
    Under a pipeline schedule (pp > 1: ``pp_microbatches`` micro-batches; or
    ``pipeline_stage``: a pp = 1 job priced as one stage of a pipeline, its micro-batches
    ``trainer.grad_accum_steps``) FSDP gathers as a stage does and reduces once; without
    one, as the accumulation loop over ``trainer.grad_accum_steps`` micro-batches does."""
    scheduled = dims.pp > 1 or pipeline_stage
    m = dims.pp_microbatches if dims.pp > 1 else trainer.grad_accum_steps
    gathers = fsdp_gathers(m, parallel.reshard_after_forward, scheduled)
    return StagePasses(m, gathers, 1 if scheduled else grad_reductions(dims, trainer))


def _stage(
    tally: _Tally,
    model_cfg: ModelConfig,
    dims: ParallelDims,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    trainer: TrainerConfig,
    stage: int,
    passes: StagePasses,
) -> None:
    """The stage counter: what a rank of pipeline ``stage`` (of ``dims.pp_stages``; stage 0 of
    1 without pipeline parallel) sends in a step run as ``passes``: the stage-to-stage sends,
    the data parallel collectives of the stage's parameters (float8 weights at one byte per
    element under float8 all-gather), and the context and tensor parallel collectives of its
    blocks and ends (module docstring)."""
    m, compute = passes.micro_batches, _dtype_bytes(precision.param_dtype)
    ends = (stage == 0, stage == dims.pp_stages - 1)  # holds the embedding; the output layer
    rows = trainer.global_batch_size // dims.dp  # the rank's rows a step, over micro-batches
    sp = parallel.sequence_parallel
    sends = (not ends[1]) + (not ends[0])  # activations forward, gradients back
    hidden = stage_send_bytes(model_cfg, precision, sp, rows // m, dims.cp, dims.tp)
    tally.add("send/pp", sends * m, sends * m * hidden)
    units = unit_sizes(model_cfg, dims, trainer.freeze, sp, stage)
    f8 = (
        float8_weight_sizes(model_cfg, dims, sp, stage)
        if float8.gathers_float8(precision, dims.dp_mode)
        else {}
    )
    _data_parallel(tally, units, f8, dims, precision, passes.gathers, passes.reductions)
    if dims.cp > 1:
        _context_parallel(tally, model_cfg, dims, parallel, precision, trainer, stage, m)
    if dims.tp > 1:
        _tensor_parallel(
            tally,
            model_cfg,
            parallel,
            rows * model_cfg.seq_len // dims.cp,
            compute,
            m,
            passes.reductions,
            len(dims.stage_blocks(model_cfg.n_layers)[stage]),
            ends,
        )


def grad_reductions(dims: ParallelDims, trainer: TrainerConfig) -> int:
    """How many times a step reduce-scatters the gradients over FSDP's group
    (``sharding.set_gradient_sync``): every micro-batch with ``trainer.accum_reduce=every``
    when they are sharded (``dp_shard x cp`` > 1), else once, on the last micro-batch. Whole
    replicas (DDP) and HSDP's replicate dim all-reduce once a step either way."""
    if dims.dp_shard_cp > 1 and AccumReduce(trainer.accum_reduce) is AccumReduce.every:
        return trainer.grad_accum_steps
    return 1


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


def stage_send_bytes(
    model_cfg: ModelConfig,
    precision: PrecisionConfig,
    sequence_parallel: bool,
    rows: int,
    cp: int,
    tp: int,
) -> int:
    """Bytes of one stage-to-stage send (``send/pp``) of a micro-batch of ``rows`` sequences:
    its hidden state, rows x seq_len / ``cp`` x dim in the compute dtype, / ``tp`` when
    sequence parallel leaves it sequence-sharded."""
    hidden = rows * model_cfg.seq_len // cp * model_cfg.dim * _dtype_bytes(precision.param_dtype)
    return hidden // (tp if tp > 1 and sequence_parallel else 1)


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
    pp_rank: int = 0,
) -> dict[str, dict[str, int]]:
    """Return the part of ``analytic_comm`` that is context parallel's key/value exchange
    ({'all_gather/cp', 'reduce_scatter/cp': {'calls', 'bytes'}}; empty when cp = 1): the
    stage counter's context parallel term over the rank's stages. Same arguments as
    ``analytic_comm`` (``pipeline_stage`` leaves the exchange as it is). The planner prices
    it apart from FSDP's collectives, which share the 'cp' keys when dp_shard = 1."""
    tally = _Tally()
    if dims.cp > 1:
        m = stage_passes(dims, parallel, trainer).micro_batches
        for stage in _rank_stages(pp_rank, dims):
            _context_parallel(tally, model_cfg, dims, parallel, precision, trainer, stage, m)
    return tally.result()


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
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    trainer: TrainerConfig,
    stage: int,
    micro_batches: int,
) -> None:
    """The K/V all-gather of every block of pipeline ``stage`` (again under full AC) and its
    gradients' reduce-scatter, in each of ``micro_batches``, for the rank's rows a step."""
    layers = len(dims.stage_blocks(model_cfg.n_layers)[stage])
    rows = trainer.global_batch_size // dims.dp  # over the micro-batches
    kv_width = model_spec(model_cfg).kv_dim() // dims.tp  # the rank's K/V heads under TP
    gathered = 2 * rows * model_cfg.seq_len * kv_width * _dtype_bytes(precision.param_dtype)
    passes = 2 if parallel.ac == AC.full else 1
    cp = dims.same_group("cp")
    tally.add(f"all_gather/{cp}", passes * layers * micro_batches, passes * layers * gathered)
    tally.add(f"reduce_scatter/{cp}", layers * micro_batches, layers * gathered)


def _tensor_parallel(
    tally: _Tally,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    tokens: int,
    compute: int,
    accum: int,
    reductions: int,
    layers: int,
    ends: tuple[bool, bool],
) -> None:
    """TP's activation collectives of a stage's ``layers`` blocks and ``ends`` (whether it
    holds the embedding, the output layer) for ``tokens`` a step over ``accum`` passes, and
    the norms' partial gradients ``reductions`` times; ``parallel`` says whether sequence
    parallel, full AC and the loss on vocabulary-sharded logits (``train/loss.py``) apply."""
    sequence_parallel, loss_parallel = parallel.sequence_parallel, parallel.loss_parallel
    recompute = parallel.ac == AC.full
    all_layers, dim = model_cfg.n_layers, model_cfg.dim
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
