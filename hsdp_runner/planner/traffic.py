"""What a block does between its matmuls, traced from the model's own code: the bytes it moves
and the kernels it launches, eager or compiled (this module's one job; ``precision_cost``
prices them).

The model with one and with two blocks, at two token counts (``TRACE_TOKENS``), runs forward,
the trainer's loss and backward on the meta device under a dispatch mode that sees every op
(``_Trace``). Matmuls, attention and views move nothing here; every other op, eager, reads its
inputs and writes its outputs once (``_moved``, eager). Compiled (each block through Inductor),
a run of such ops between two matmuls is assumed to be one fused kernel, so only tensors that
cross a boundary move: one written by an element-wise op and read by a matmul, by the other
pass (forward -> backward) or by nothing in the block, and one produced by a matmul or from
outside and read by an element-wise op. Outside the blocks (embedding, final norm, loss)
nothing is compiled. The per-token and per-forward parts come from the two token counts, per
block and outside-block parts from the two depths. The same traces count the kernels a
micro-batch launches (``_launches``: every matmul and attention call, and every element-wise op
eager or every fused run compiled). Kernels are the ones a job on ``device_type`` runs
(``_kernels_of``: the RMSNorm as torch's fused kernels on CUDA, op by op on a CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hsdp_runner.config.schema import PrecisionConfig
from hsdp_runner.core.choices import AC, DPMode
from hsdp_runner.distributed import float8
from hsdp_runner.distributed.parallelize import SDPA_FORWARD_OPS, apply_ac
from hsdp_runner.models import norm_rope
from hsdp_runner.models.base import (
    ModelConfig,
    model_fields,
    model_spec,
    moe_layers,
    routed_experts,
)
from hsdp_runner.models.norm_rope import fused_rms_norm as _fused_rms_norm

_aten = torch.ops.aten
# Ops that are fusion boundaries and are priced as FLOPs, not bytes: matmuls (the experts'
# grouped ones too, ``expert_matmul``: else every expert's weights would be counted as bytes
# the work between matmuls moves) and attention.
_MATMUL_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_mm",
    "_grouped_mm",
    "_scaled_grouped_mm",
    *SDPA_FORWARD_OPS,
)
_BOUNDARY_PACKETS = {getattr(_aten, n) for n in _MATMUL_NAMES if hasattr(_aten, n)} | {
    getattr(_aten, f"{n}_backward") for n in SDPA_FORWARD_OPS if hasattr(_aten, f"{n}_backward")
}
# Ops that allocate or alias only.
_FREE_PACKETS = {
    _aten.empty,
    _aten.empty_like,
    _aten.zeros,
    _aten.zeros_like,
    _aten.ones_like,
    _aten.detach,
    _aten.lift_fresh,
    _aten.new_empty,
    _aten.new_empty_strided,
    _aten.empty_strided,
    _aten._unsafe_view,  # a view without aliasing information
}
TRACE_TOKENS = (16, 32)  # two token counts: bytes = per token x tokens + per forward


@dataclass(frozen=True)
class TraceSetting:
    """How the traced step runs: its kernels as a ``device_type`` job runs them ('cuda',
    'cpu': ``Cluster.device_type``), a model with experts routing its tokens in ``chunks``
    (``expert_parallel.exchange_chunks``: each chunk's routing, grouped matmuls and weighted
    sum are kernels of their own; the all-to-alls are communication, priced there) and, with
    ``moe_ac`` ``AC.moe`` or ``AC.moe_act`` (``parallel.ac``), recomputing its MoE blocks'
    feed-forward or its experts' activation in backward, as the job's build has it
    (``parallelize.apply_ac``: traced as backward's work); the loss in fp32 where
    ``loss_fp32`` (``trainer.loss_fp32``)."""

    device_type: str = "cuda"
    chunks: int = 1
    moe_ac: AC = AC.none
    loss_fp32: bool = True


def _nbytes(t: torch.Tensor) -> int:
    data = getattr(t, "_data", None)  # torchao's Float8TrainingTensor: its float8 payload
    return (data if isinstance(data, torch.Tensor) else t).numel() * (
        (data if isinstance(data, torch.Tensor) else t).element_size()
    )


class _Trace(TorchDispatchMode):
    """Records (pass, kind, input ids, output ids) of every op and each tensor's bytes; views
    take their input's id (they alias it)."""

    def __init__(self):
        super().__init__()
        self.ops, self.sizes, self.alias, self.phase = [], {}, {}, "forward"
        self.in_attention = False  # set by _Attention: its ops are attention's (FLOPs)
        self.in_kernel = False  # set by _one_kernel_rms_norm: its ops are one kernel's
        self.scalars = set()  # tensors of one element (a reduction's result: torchao's amax)
        self.attention_calls = defaultdict(int)  # per pass: one fused kernel each
        self.keep = []  # every output stays alive while tracing, so no id is reused
        # The routed experts' stacked weights' shapes: an element-wise op writing one is the
        # sum of a weight's gradients over the token exchange's chunks, whose bytes are the
        # rank's local experts' (``expert_grad_sum_bytes``), not the traced model's every
        # expert; it is a launch, not counted in ``_moved``.
        self.expert_shapes: set[tuple[int, ...]] = set()

    def _id(self, t) -> int:
        key = id(t)
        return self.alias.get(key, key)

    def one_kernel(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Record one element-wise kernel reading ``ins`` and writing ``outs`` (the ops that
        computed them on meta were not recorded: ``in_kernel``)."""
        for t in ins + outs:
            self.sizes.setdefault(self._id(t), _nbytes(t))
        self.ops.append(
            (self.phase, "elementwise", [self._id(t) for t in ins], [self._id(o) for o in outs])
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in = [a for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))]
        flat_out = torch.utils._pytree.tree_leaves(out)
        ins = [a for a in flat_in if isinstance(a, torch.Tensor)]
        outs = [o for o in flat_out if isinstance(o, torch.Tensor)]
        packet = func.overloadpacket
        self.keep += outs
        if self.in_kernel:
            return out
        if func.is_view or packet in _FREE_PACKETS:
            for o in outs:
                if ins:
                    self.alias[id(o)] = self._id(ins[0])
            return out
        kind = "attention" if self.in_attention else "elementwise"
        kind = "matmul" if packet in _BOUNDARY_PACKETS and not self.in_attention else kind
        if kind == "elementwise" and any(tuple(o.shape) in self.expert_shapes for o in outs):
            kind = "expert_grad_sum"
        if packet is _aten.embedding:  # reads the looked-up rows only, not the whole table
            ins = [o.detach() for o in outs]
            self.keep += ins
        for t in ins + outs:
            self.sizes.setdefault(self._id(t), _nbytes(t))
            if t.numel() == 1:
                self.scalars.add(self._id(t))
        self.ops.append((self.phase, kind, [self._id(t) for t in ins], [self._id(o) for o in outs]))
        return out


class _Attention(torch.autograd.Function):
    """scaled_dot_product_attention as one opaque step of the trace, forward and backward.

    On the meta device torch decomposes attention into matmuls, a mask and a softmax over
    seq x seq scores, which a GPU's fused kernel never writes to memory; attention is priced
    as FLOPs, so its ops are marked as such (``_Trace.in_attention``)."""

    trace: _Trace | None = None
    sdpa = staticmethod(torch.nn.functional.scaled_dot_product_attention)

    @staticmethod
    def forward(ctx, q, k, v, is_causal, enable_gqa):
        ctx.save_for_backward(q, k, v)
        ctx.is_causal, ctx.enable_gqa = is_causal, enable_gqa
        _Attention.trace.attention_calls[_Attention.trace.phase] += 1
        _Attention.trace.in_attention = True
        try:
            return _Attention.sdpa(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
        finally:
            _Attention.trace.in_attention = False

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        _Attention.trace.attention_calls[_Attention.trace.phase] += 1
        _Attention.trace.in_attention = True
        try:
            with torch.enable_grad():
                out = _Attention.sdpa(q, k, v, is_causal=ctx.is_causal, enable_gqa=ctx.enable_gqa)
            return (*torch.autograd.grad(out, (q, k, v), grad), None, None)
        finally:
            _Attention.trace.in_attention = False


def _one_kernel_rms_norm(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_rope.fused_rms_norm`` as the GPU runs it, one kernel reading ``x`` and writing the
    normalised value and rstd: on meta torch decomposes it into the op-by-op norm."""
    trace = _Attention.trace
    trace.in_kernel = True
    try:
        outs = _fused_rms_norm(x, eps)
    finally:
        trace.in_kernel = False
    trace.one_kernel([x], list(outs))
    return outs


def _opaque_sdpa(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, **kwargs
):
    return _Attention.apply(q, k, v, is_causal, enable_gqa)


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank moves through memory outside the matmuls, for one micro-batch of
    ``tokens`` tokens: ``per_token`` x tokens + ``per_forward``, split into the blocks'
    forward, the blocks' backward and the rest (outside the blocks, forward and backward)."""

    block_forward: tuple[float, float]  # (per token, per forward), all blocks
    block_backward: tuple[float, float]
    rest: tuple[float, float]
    # Kernel launches of one micro-batch (no count grows with tokens), by the same parts.
    launches: dict[str, int] = dataclasses.field(default_factory=dict)

    def bytes(self, part: str, tokens: float) -> float:
        per_token, per_forward = getattr(self, part)
        return per_token * tokens + per_forward


def _moved(trace: _Trace, compiled: bool) -> dict[str, int]:
    """Bytes per pass ('forward', 'backward') of a trace, eager or compiled.

    Each op runs in a kernel; a tensor written in one kernel and read in another (or by
    nothing: a pass's output, or saved for the other pass) is written once, and read once by
    each other kernel that reads it. Eager, every op is a kernel of its own. Compiled, a kernel
    runs from one boundary to the next: a matmul or attention (kernels of their own), and the
    end of a reduction to one value (tensorwise amax: the cast after it needs the whole
    reduction, so it re-reads its input). Matmul kernels' own reads and writes are FLOPs' time,
    not counted here. A reduction per row (rowwise scales) fuses with its row's work."""
    moved: dict[str, int] = defaultdict(int)
    kernel, made, readers = 0, {}, defaultdict(set)
    for phase, kind, ins, outs in trace.ops:
        boundary = kind != "elementwise" or not compiled
        kernel += 1 if boundary else 0
        for i in ins:
            readers[i].add((phase, kernel, kind))
        for o in outs:
            made[o] = (phase, kernel, kind)
        reduced = bool(outs) and all(o in trace.scalars for o in outs)  # a whole-tensor reduction
        kernel += 1 if boundary or reduced else 0
    for tensor, size in trace.sizes.items():
        source = made.get(tensor)
        reads = readers[tensor]
        if source is not None and source[2] == "elementwise":
            if not reads or any(r[:2] != source[:2] for r in reads):
                moved[source[0]] += size
        for phase, kern, kind in reads:
            if kind == "elementwise" and (source is None or source[:2] != (phase, kern)):
                moved[phase] += size
    return moved


def _launches(trace: _Trace, compiled: bool) -> dict[str, int]:
    """Kernel launches per pass ('forward', 'backward') of a trace: each matmul and attention
    call one; eager, every element-wise op one, compiled each run of them between two matmuls
    or attention calls (``_moved``'s fusion, a whole-tensor reduction not splitting a run)."""
    launches: dict[str, int] = defaultdict(int)
    previous = None
    for phase, kind, _, _ in trace.ops:
        if kind in ("matmul", "expert_grad_sum") or (
            kind == "elementwise" and not (compiled and previous == kind)
        ):
            launches[phase] += 1
        previous = kind
    for phase, calls in trace.attention_calls.items():
        launches[phase] += calls
    return launches


def _trace_model(
    fields: str,
    recipe: str,
    layers: int,
    tokens: int,
    compiled: bool,
    setting: TraceSetting = TraceSetting(),
) -> dict:
    """Bytes per pass of ``layers`` blocks (model ``fields``, JSON) on ``tokens`` tokens, the
    step run as ``setting`` says."""
    return _moved(_run_trace(fields, recipe, layers, tokens, setting), compiled)


def _trace_launches(
    fields: str, recipe: str, layers: int, compiled: bool, setting: TraceSetting = TraceSetting()
) -> dict[str, int]:
    """Kernel launches per pass of ``layers`` blocks (model ``fields``, JSON), eager or
    ``compiled``, the step run as ``setting`` says."""
    return _launches(_run_trace(fields, recipe, layers, TRACE_TOKENS[0], setting), compiled)


@functools.lru_cache(maxsize=16)
def _run_trace(fields: str, recipe: str, layers: int, tokens: int, setting: TraceSetting) -> _Trace:
    """The trace of ``layers`` blocks of model ``fields`` (JSON) on ``tokens`` tokens: the
    trainer's forward, loss and backward, run as ``setting`` says (``TraceSetting``)."""
    cfg = dict(json.loads(fields), n_layers=layers, seq_len=tokens)
    spec = model_spec(cfg)
    with torch.device("meta"):
        model = spec.build().to(torch.bfloat16)
    for layer in moe_layers(model):
        layer.exchange.chunks = setting.chunks  # its own LocalExchange: every expert here
    if setting.moe_ac is not AC.none:
        apply_ac(model, setting.moe_ac)
    precision = PrecisionConfig(name="trace", float8=recipe)
    # Traced as a GPU runs it (not emulated): on meta, emulation would add its own upcasts.
    # The routed experts stay unconverted (``float8_experts.convert`` is not called): their
    # float8 grouped matmul is refused by the planner (matmul_shapes.check_plannable).
    float8.convert(model, precision, torch.device("meta"), DPMode.none, cfg["vocab_size"])
    tokens_in = torch.zeros((1, tokens), dtype=torch.long, device="meta")
    with _kernels_of(setting.device_type) as trace:
        trace.expert_shapes = {
            tuple(w.shape)
            for layer in moe_layers(model)
            for w in layer.parameters()
            if w.dim() == 3
        }
        _forward_backward(model, tokens_in, trace, setting.loss_fp32)
    trace.keep = []  # the ids are read; the tensors need not stay alive
    return trace


@contextlib.contextmanager
def _kernels_of(device_type: str):
    """A ``_Trace`` entered with attention and the norms on meta seen as a ``device_type`` job
    runs them: attention as one opaque step (``_Attention``); the norms as torch's fused
    kernels where that device has them (``norm_rope.FUSED_NORM_DEVICES``, each forward one
    kernel: ``_one_kernel_rms_norm``), else op by op."""
    trace = _Trace()
    _Attention.trace = trace
    functional = torch.nn.functional
    functional.scaled_dot_product_attention = _opaque_sdpa
    fused_norms = device_type in norm_rope.FUSED_NORM_DEVICES
    if fused_norms:
        norm_rope.fused_rms_norm = _one_kernel_rms_norm
        norm_rope.FUSED_NORM_DEVICES.add("meta")
    try:
        with trace:
            yield trace
    finally:
        functional.scaled_dot_product_attention = _Attention.sdpa
        if fused_norms:
            norm_rope.fused_rms_norm = _fused_rms_norm
            norm_rope.FUSED_NORM_DEVICES.discard("meta")
        _Attention.trace = None


def _forward_backward(model, tokens_in, trace: _Trace, loss_fp32: bool) -> None:
    """The trainer's forward, loss (in fp32 where ``loss_fp32``) and backward on
    ``tokens_in`` (targets: the same tokens).
    The trace's token counts keep the logits below ``loss.CHUNK_ELEMENTS``: a job's loss in
    chunks also recomputes each chunk's fp32 log-softmax in backward, one more pass over the
    logits that is not counted (about 1.5 MB a token at a 151,936-token vocabulary)."""
    from hsdp_runner.train.loss import next_token_loss

    logits = model(tokens_in)
    loss = next_token_loss(logits, tokens_in, fp32=loss_fp32)
    trace.phase = "backward"
    # autograd.grad, not backward(): no accumulation into .grad (FSDP reduce-scatters the
    # gradients; its copies are communication's, priced there).
    torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


@functools.lru_cache(maxsize=64)
def _traffic(
    fields: str,
    recipe: str,
    compiled: bool,
    n_dense: int | None = None,
    setting: TraceSetting = TraceSetting(),
) -> Traffic:
    """The traffic of the model ``fields`` (JSON), its step run as ``setting`` says: each kind
    of block traced apart (a model with experts, ``n_dense`` its dense blocks before the MoE
    ones: ``_block_kinds``; None: a dense model) and counted as often as the model holds it;
    the rest from one- and two-block traces of one kind."""
    a, b = TRACE_TOKENS
    n_layers = json.loads(fields)["n_layers"]

    def fit(values: dict) -> tuple[float, float]:
        per_token = (values[b] - values[a]) / (b - a)
        return per_token, values[a] - per_token * a

    def block(runs_one, runs_two, phase):
        return fit({n: runs_two[n][phase] - runs_one[n][phase] for n in TRACE_TOKENS})

    fwd, bwd = (0.0, 0.0), (0.0, 0.0)
    launches = {"block_forward": 0, "block_backward": 0}
    kinds = _block_kinds(fields, n_layers, n_dense)
    for kind, count in kinds:
        one_l, two_l = (_trace_launches(kind, recipe, n, compiled, setting) for n in (1, 2))
        launches["block_forward"] += (two_l["forward"] - one_l["forward"]) * count
        launches["block_backward"] += (two_l["backward"] - one_l["backward"]) * count
        one, two = (
            {n: _trace_model(kind, recipe, depth, n, compiled, setting) for n in TRACE_TOKENS}
            for depth in (1, 2)
        )
        f, w = block(one, two, "forward"), block(one, two, "backward")
        fwd = (fwd[0] + f[0] * count, fwd[1] + f[1] * count)
        bwd = (bwd[0] + w[0] * count, bwd[1] + w[1] * count)
    # Outside the blocks: the one-block model less one block of the same kind, eager (the
    # blocks' chunks and recompute cancel there).
    outside = dataclasses.replace(setting, chunks=1, moe_ac=AC.none)
    eager_one, eager_two = (
        {n: _trace_model(kinds[0][0], recipe, depth, n, False, outside) for n in TRACE_TOKENS}
        for depth in (1, 2)
    )
    rest = fit(
        {n: 2 * sum(eager_one[n].values()) - sum(eager_two[n].values()) for n in TRACE_TOKENS}
    )
    one_l, two_l = (_trace_launches(kinds[0][0], recipe, n, False, outside) for n in (1, 2))
    launches["rest"] = 2 * sum(one_l.values()) - sum(two_l.values())
    return Traffic(block_forward=fwd, block_backward=bwd, rest=rest, launches=launches)


def _block_kinds(fields: str, n_layers: int, n_dense: int | None) -> list[tuple[str, int]]:
    """(model fields whose one- and two-block traces differ by one block of a kind, blocks of
    that kind in the model): a dense model's own fields, all ``n_layers``; for a model with
    experts, its MoE blocks (traced with no dense block) and its ``n_dense`` dense ones
    (traced with two dense blocks: both traced blocks dense). The traced model's first
    ``model.n_dense_layers`` blocks are dense, so tracing the model as it is would price every
    block as its first ones."""
    if n_dense is None:
        return [(fields, n_layers)]
    plain = json.loads(fields)
    kinds = ((0, n_layers - n_dense), (2, n_dense))
    return [
        (json.dumps({**plain, "n_dense_layers": dense}, sort_keys=True), count)
        for dense, count in kinds
        if count
    ]


def traffic(
    model_cfg: ModelConfig,
    precision: PrecisionConfig,
    compiled: bool,
    device_type: str = "cuda",
    chunks: int = 1,
    moe_ac: AC = AC.none,
    loss_fp32: bool = True,
) -> Traffic:
    """The memory traffic outside matmuls of ``model_cfg`` in ``precision`` (float8 casts
    included), eager or ``compiled`` (module docstring), its kernels as a ``device_type``
    ('cuda', 'cpu': ``Cluster.device_type``) job runs them, a model with experts routing its tokens
    in ``chunks`` (``expert_parallel.exchange_chunks``) and with ``moe_ac`` (``parallel.ac``
    moe or moe_act; any other mode counts as none here) recomputing its MoE blocks'
    feed-forward or its experts' activation in backward, the loss in fp32 where ``loss_fp32`` (``trainer.loss_fp32``); cached per shape."""
    fields = model_fields(model_cfg)
    fields.pop("seq_len", None)
    fields["seq_len"] = 1
    n_dense = getattr(model_cfg, "n_dense_layers", 0) if routed_experts(model_cfg) else None
    if n_dense is not None:
        # The per-expert loop splits its rows by host values, which meta tensors do not have;
        # between matmuls it does what the grouped path does (its slices are views).
        fields["grouped_mm"] = True
    return _traffic(
        json.dumps(fields, sort_keys=True, default=str),
        str(precision.float8),
        compiled,
        n_dense,
        TraceSetting(
            device_type,
            chunks if n_dense is not None else 1,
            AC(moe_ac) if AC(moe_ac).needs_moe and n_dense is not None else AC.none,
            loss_fp32,
        ),
    )
