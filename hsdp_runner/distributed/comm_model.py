"""Analytic communication per training step, from the model shape, the layout and the dtypes.

What one rank sends through collectives in one optimizer step, counted like
``comm_counting.py`` counts what it measures (the full tensor of each collective: gathered
output, reduce-scatter input, all-reduce tensor), keyed ``'<kind>/<mesh dim>'``. Collectives
over groups of one rank move nothing and are in neither.

One counter, ``_stage``, counts what a rank of one pipeline stage sends in a step: its
stage-to-stage sends, the FSDP/HSDP/DDP collectives of the stage's parameters, and the context
and tensor parallel collectives of its blocks and ends. ``analytic_comm`` sums it over the
rank's stages and adds what the rank reduces once a step over all of them: a mixture of
experts' balance step and the step's stats (which carry the grad norm's squares). A job
without pipeline parallel is one stage holding both ends (embedding and output layer), with no sends; its micro-batches are
``trainer.grad_accum_steps``. How the stage's step passes (micro-batches, FSDP's gathers and
gradient reductions) is ``step_passes.stage_passes``: the accumulation loop's, or a pipeline
schedule's (pp > 1, or a pp = 1 job the planner prices as one stage of a pipeline,
``pipeline_stage``). The parameter sizes it counts with are ``param_sizes``'. The model
follows what the runner builds (``parallelize.py``):

- FSDP (``dp_shard x cp`` > 1: it shards over ``dp_shard_cp``, reported under the name of the
  group's first dim, ``ParallelDims.same_group``): one all-gather per FSDP unit (each block,
  then the root: embedding, final norm, output) in every micro-batch's forward, in
  ``precision.param_dtype``; with ``reshard_after_forward`` the blocks are gathered again in
  backward (the root is never resharded after forward: ``parallelize.apply_data_parallel``);
  one reduce-scatter per unit of the trainable gradients in ``precision.reduce_dtype`` in
  every micro-batch with ``trainer.accum_reduce=every``, in the last one alone with ``last``
  (``grad_reductions``, ``parallelize.set_gradient_sync``). FSDP pads each parameter's dim 0
  to a multiple of the shard degree; the model pads the same way.
- Float8 all-gather (``precision.float8_all_gather`` under FSDP/HSDP, ``float8.gathers_float8``):
  the weights of the float8 linears (``float8_weight_sizes``) are gathered at one byte per
  element, the other parameters as above; after each optimizer step torchao's scale
  precompute all-reduces one amax per float8 weight (master dtype) over the shard group.
  Float8 TP (torchao's float8 styles move some activations in float8) is not modelled, nor
  the first step, which has no precomputed scales yet: torchao then all-reduces each float8
  weight's amax (one fp32) at each of its gathers (``metrics.comm_step=2`` counts a step the
  model counts).
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
  parallel, per block an all-gather before attention and before the FFN and a reduce-scatter
  after each (and their mirror images in backward), the embedding's reduce-scatter
  (all-gather in backward), the output layer's input all-gather (reduce-scatter in backward),
  the logits' all-gather (n x vocab; its backward is a local slice) or, with
  ``parallel.loss_parallel`` (the default), instead of it the loss's three all-reduces of n
  fp32 each on the vocabulary-sharded logits (row max, sum of exponentials, target logit;
  ``train/loss.py``; its backward is local), and
  the all-reduce of the sequence-parallel norm parameters' ``Partial`` gradients (the
  trainable ones, ``param_sizes.tp_partial_grads``, one call each;
  ``partial_grad_reductions``): under a
  data-parallel wrapper FSDP reduces them at each of its gradient reductions
  (``grad_reductions``), in the compute dtype when every micro-batch reduces its own, else in
  the reduce dtype FSDP accumulated them in; without one (no dp, ``param_dtype`` =
  ``master_dtype``) DTensor reduces them for each op that reads them, the clip's norm and the
  fused AdamW step: twice a step. Without sequence parallel those become all-reduces of the
  same tensors.
  With ``parallel.ac=full`` backward recomputes each block's forward, its TP collectives
  included, up to the last op whose output backward needs (torch's checkpoint stops early):
  per block the 2 all-gathers and the attention output's reduce-scatter with sequence
  parallel, the attention output's all-reduce without; the FFN output's reduce is the block's
  output, which backward never needs. ``selective`` saves their outputs
  (``parallelize.apply_ac``) and repeats none. With ``parallel.sp_save_shard`` backward
  all-gathers each block's attention input and dense feed-forward input once more
  (``sp_saves``: the shard its linears saved); the attention's, which runs beside the
  attention backward, is also returned alone (``attention_regather_comm``) for the planner
  to price apart.
- Pipeline parallel: each of the rank's stages (``ParallelDims.local_stages``) is counted as
  above with its own parameters (its blocks, the embedding on the first stage, the output
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
  chunk). The first step also runs
  torch's runtime shape inference (metadata sends and a forward that gathers FSDP's units
  once more), so a pipeline job counts a later one (``metrics.comm_step=1``, the default,
  counts step 2 there). The zero-bubble schedule's split backward (input, then weights)
  gathers and reduces as the others do: measured so with FSDP inside the stages.
- Gradient clipping (``train/grad_clip``): no collective of its own. Each rank's share of
  the squared norm rides in the step's stats vector; a ``Partial`` gradient (the
  sequence-parallel norms' without a data-parallel wrapper) is summed for its norm, counted
  above with TP.
- A mixture of experts (``moe_comm``): with its MoE layers' own FSDP units (expert parallel
  or TP: experts over ``efsdp``, router and shared experts over ``dp_shard_cp_tp``, HSDP
  adding ``dp_replicate``; ``param_sizes.unit_views``) gathered and reduced as the blocks are
  (without a data-parallel wrap around them, TP alone: every micro-batch, pipeline or not);
  the token exchange's all-to-alls over ``ep``, whose rows come from the counted step's
  routing (``routing``); the auxiliary loss's count all-reduce over ``cp_tp``; the balance
  step's all-reduce; an MoE block's TP collectives are attention's alone (the MoE runs on
  the rank's part of the sequence; without sequence parallel its output and its input's
  gradient are all-gathered).
- The trainer's own all-reduce over all ranks: loss sum, non-finite flag, the grad norm's
  squares and stop request in one small fp32 vector (``step_stats.STATS_BYTES``).

What a step measures equals this count, per (kind, mesh dim), calls and bytes, in every layout
``tests/test_comm.py`` and ``tests/test_pipeline.py`` run (FSDP, HSDP, DDP, TP with and without
FSDP, cp, pp, frozen parameters, float8 all-gather from its second step; a mixture of experts
with expert parallel over dp_shard, tp and cp, HSDP, TP alone, pp, full and selective AC and
accumulation). Where they part:
float8's first step and float8 TP (above); a frozen start of the model, where autograd runs
no backward before the first trainable parameter: a frozen token embedding under sequence
parallel skips its backward all-gather, frozen leading blocks of the first stage their
backward TP and cp collectives, all of which the model counts (FSDP still gathers those
blocks, by its backward prefetch); and frozen norms under sequence parallel, which the model
counts without gradients while torch 2.13's ``SequenceParallel`` re-creates their parameters
with ``requires_grad`` on, so the runner trains them.
"""

from __future__ import annotations

from collections import defaultdict

from hsdp_runner.config.schema import ParallelConfig, PrecisionConfig, TrainerConfig
from hsdp_runner.core.choices import AC
from hsdp_runner.distributed import float8
from hsdp_runner.distributed.moe_comm import balance_bytes, routed_rows, stage_moe_comm
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.distributed.param_sizes import (
    float8_weight_sizes,
    moe_blocks,
    tp_partial_grads,
    unit_sizes,
    unit_views,
)
from hsdp_runner.distributed.sp_saves import saves_shard
from hsdp_runner.distributed.step_passes import (
    StagePasses,
    fsdp_gathers,
    has_dp_wrapper,
    partial_grad_reductions,
    stage_passes,
)
from hsdp_runner.distributed.step_stats import STATS_BYTES
from hsdp_runner.distributed.world_mesh import group_order
from hsdp_runner.models.base import ModelConfig, model_spec
from hsdp_runner.models.params import torch_dtype

# The loss on vocabulary-sharded logits reduces fp32 values (it runs on the fp32 logits).
LOSS_BYTES = 4


def _dtype_bytes(name: str) -> int:
    return torch_dtype(name).itemsize


class _Tally:
    def __init__(self):
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})

    def add(self, key: str, calls: int, nbytes: int) -> None:
        if calls and nbytes:
            self.counts[key]["calls"] += calls
            self.counts[key]["bytes"] += nbytes

    def add_bytes(self, key: str, nbytes: int) -> None:
        """Bytes of calls counted already (the token exchange's rows: a call may move none)."""
        if nbytes:
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
    routing: list[tuple[int, int]] | None = None,
) -> dict[str, dict[str, int]]:
    """Return {'<kind>/<dim>': {'calls', 'bytes'}} one rank communicates in one step.

    Takes the ``model``, ``parallel``, ``precision`` and ``trainer`` config nodes, the job's
    ParallelDims and, under pipeline parallel, the rank's ``pp`` coordinate. Sums the stage
    counter (``_stage``) over the rank's stages (``ParallelDims.local_stages``; without pipeline
    parallel the one stage, holding both ends), then adds the step's reductions over them
    all: a mixture of experts' balance step and the step's stats (the grad norm's squares
    among them). ``pipeline_stage``: the job (pp = 1) is one stage of a
    pipeline, as the planner prices a stage, with ``trainer.grad_accum_steps`` its
    micro-batches (``stage_passes``). ``routing``: under expert parallel, the rows the rank's
    token exchange sent and received in each forward dispatch of the counted step
    (``expert_parallel.recording_routing``; None: balanced, ``moe_comm.routed_rows``). See
    the module docstring for what is counted.
    """
    tally = _Tally()
    passes = stage_passes(dims, parallel, trainer, pipeline_stage)
    stages = dims.local_stages(pp_rank)
    for stage in stages:
        _stage(tally, model_cfg, dims, parallel, precision, trainer, stage, passes)
    for key, nbytes in routed_rows(
        model_cfg, dims, parallel, precision, trainer, stages, routing
    ).items():
        tally.add_bytes(key, nbytes)
    if dims.world_size > 1:
        tally.add(f"all_reduce/{world_dim(dims)}", 1, balance_bytes(model_cfg))
        tally.add(f"all_reduce/{world_dim(dims)}", 1, STATS_BYTES)
    return tally.result()


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
    views = unit_views(model_cfg, dims, sp, stage)
    for view in dict.fromkeys(views.values()):  # the dense units, then the MoE layers' own
        mine = {unit: sizes for unit, sizes in units.items() if views[unit] == view}
        # The MoE layers' own units without a data-parallel wrap around them (TP without
        # dp): neither the accumulation loop nor a pipeline schedule reaches them (both switch
        # the wrap of the whole stage), so every micro-batch gathers and reduces them.
        if view == "dp_shard_cp" or has_dp_wrapper(dims, precision):
            gathers, reductions = passes.gathers, passes.reductions
        else:
            gathers, reductions = fsdp_gathers(m, parallel.reshard_after_forward, False), m
        f8_mine = {unit: f8[unit] for unit in mine if unit in f8}
        _data_parallel(tally, mine, f8_mine, dims, precision, gathers, reductions, view)
    stage_moe_comm(tally, model_cfg, dims, parallel, trainer, stage, m)
    if dims.cp > 1:
        _context_parallel(tally, model_cfg, dims, parallel, precision, trainer, stage, m)
    if dims.tp > 1:
        _tensor_parallel(
            tally,
            model_cfg,
            parallel,
            _rank_tokens(model_cfg, dims, trainer),
            compute,
            m,
            _stage_layers(model_cfg, dims, stage),
            ends,
        )
        # The norms' partial gradients (sequence parallel): each all-reduced on its own.
        times, width = partial_grad_reductions(dims, precision, passes)
        partial = tp_partial_grads(model_cfg, dims, trainer.freeze, sp, stage)
        tally.add("all_reduce/tp", len(partial) * times, sum(partial) * width * times)


def _rank_tokens(model_cfg: ModelConfig, dims: ParallelDims, trainer: TrainerConfig) -> int:
    """The tokens of a rank's data and context slice in one step, over its micro-batches."""
    return trainer.global_batch_size // dims.dp * model_cfg.seq_len // dims.cp


def _stage_layers(model_cfg: ModelConfig, dims: ParallelDims, stage: int) -> tuple[int, int]:
    """(blocks, blocks with an MoE layer) of pipeline ``stage``."""
    return len(dims.stage_blocks(model_cfg.n_layers)[stage]), len(
        moe_blocks(model_cfg, dims, stage)
    )


def attention_regather_comm(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    trainer: TrainerConfig,
    pp_rank: int = 0,
    pipeline_stage: bool = False,
) -> dict[str, dict[str, int]]:
    """Return the part of ``analytic_comm`` that is each block's attention input all-gathered
    again in backward under ``parallel.sp_save_shard`` ({'all_gather/tp': {'calls',
    'bytes'}}; empty where its shards are not saved): started at the output projection's
    backward, it runs beside the attention backward (``sp_saves``), which the planner prices
    as hiding it. Same arguments as ``analytic_comm``."""
    tally = _Tally()
    if dims.tp > 1 and saves_shard(parallel):
        passes = stage_passes(dims, parallel, trainer, pipeline_stage)
        act = _rank_tokens(model_cfg, dims, trainer) * model_cfg.dim
        act *= _dtype_bytes(precision.param_dtype)  # one activation, as _tensor_parallel's
        for stage in dims.local_stages(pp_rank):
            calls = _stage_layers(model_cfg, dims, stage)[0]
            tally.add("all_gather/tp", calls * passes.micro_batches, calls * act)
    return tally.result()


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
    """The name ``comm.CommCounter`` gives the group of all ranks: the first mesh dim (or
    flattened view; with experts, expert group: ``world_mesh.group_order``) spanning every
    rank, else ``world``."""
    names = group_order(dims.moe)
    return next((name for name in names if dims.group_size(name) == dims.world_size), "world")


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
        for stage in dims.local_stages(pp_rank):
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
    view: str = "dp_shard_cp",
) -> None:
    """FSDP's all-gathers (``gathers``: ``fsdp_gathers``) and reduce-scatters (``reductions``
    a step) of ``units`` sharded over the group ``view`` (``param_sizes.unit_views``), HSDP's
    and DDP's all-reduces; the elements of ``float8_sizes`` (per unit) are gathered at one
    byte each, and their scales are precomputed once a step (one fp32 amax per float8 weight,
    all-reduced over the shards)."""
    gather, reduce = _dtype_bytes(precision.param_dtype), _dtype_bytes(precision.reduce_dtype)
    trainable = {unit: sizes[1] for unit, sizes in units.items() if sizes[1]}
    if dims.group_size(view) > 1:
        shard_dim = dims.same_group(view)

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
        shard = sum(trainable.values()) // dims.group_size(view)
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
    layers: tuple[int, int],
    ends: tuple[bool, bool],
) -> None:
    """TP's activation collectives of a stage's blocks (``layers``: how many, how many of them
    with an MoE layer) and ``ends`` (whether it holds the embedding, the output layer) for
    ``tokens`` a step over ``accum`` passes; ``parallel`` says whether sequence parallel, full
    AC and the loss on vocabulary-sharded logits (``train/loss.py``) apply. An MoE block has
    attention's collectives alone, its MoE running on the rank's part of the sequence: without
    sequence parallel that part is a local slice of the replicated stream, the MoE's output is
    all-gathered (forward) and so is its input's gradient (backward)."""
    sequence_parallel, loss_parallel = parallel.sequence_parallel, parallel.loss_parallel
    recompute = parallel.ac == AC.full
    dim, (first, last) = model_cfg.dim, ends
    dense, moe = layers[0] - layers[1], layers[1]
    act = tokens * dim * compute  # one residual-stream activation of the step's tokens on a rank
    if recompute:  # full AC: the blocks' forward collectives run again (module docstring)
        again = (
            {"all_gather/tp": (2, 1), "reduce_scatter/tp": (1, 1)}
            if sequence_parallel
            else {"all_reduce/tp": (1, 1)}
        )
        for kind, (per_dense, per_moe) in again.items():
            calls = per_dense * dense + per_moe * moe
            tally.add(kind, calls * accum, calls * act)
    if saves_shard(parallel):  # each saved shard gathered again in backward (sp_saves)
        calls = 2 * dense + moe
        tally.add("all_gather/tp", calls * accum, calls * act)
    if last and loss_parallel:  # per token: the row max, the sum of exponentials, the target
        tally.add("all_reduce/tp", 3 * accum, 3 * tokens * LOSS_BYTES)
    elif last:
        tally.add("all_gather/tp", accum, tokens * model_cfg.vocab_size * compute)  # logits
    # per block 2 in each pass (attention's 1 in an MoE block), the ends' 1 each
    calls = 4 * dense + 2 * moe + first + last
    if sequence_parallel:
        # with the output layer's input all-gather (forward) and the embedding's (backward);
        # the reduce-scatters mirror them
        tally.add("all_gather/tp", calls * accum, calls * act)
        tally.add("reduce_scatter/tp", calls * accum, calls * act)
    else:
        tally.add("all_reduce/tp", calls * accum, calls * act)
        # parallel.ac=moe does not run the output all-gather again: the checkpoint's recompute
        # stops once the tensors backward saved are rebuilt (torch's early stop), before it
        tally.add("all_gather/tp", 2 * moe * accum, 2 * moe * act)


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
