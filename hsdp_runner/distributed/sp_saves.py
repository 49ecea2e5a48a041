"""Sequence parallel that saves each column-parallel input as the rank's shard
(``parallel.sp_save_shard``): Megatron's rule, where torch's keeps the gathered input.

Under sequence parallel a block's attention and dense feed-forward take the residual stream
sharded on the sequence over the TP ranks and all-gather it before their column-parallel
linears (``PrepareModuleInput``: ``Shard(1)`` -> ``Replicate()``). Those linears (wq, wk, wv;
w1, w3) save the gathered input for their weight gradients, so every block holds tp shards'
worth of it through backward: 128 MiB a block for 16,384 tokens of a 4,096-wide model in bf16.
Megatron's linears save the rank's shard and all-gather it again in backward
(``LinearWithGradAccumulationAndAsyncCommunication``).

This does the same through autograd's saved-tensor hooks (``torch.autograd.graph.
saved_tensors_hooks``), on the job's own linears: while such a module runs forward, a saved
tensor that is the gathered input (or a view of it) is packed as the module's input shard and
a note of the view; each unpack gets its view of one all-gather of the shard again (one
collective for the module's linears, under no grad). Nothing else changes: the same ops, the
same values, the same gradients; backward runs one more all-gather per module (the comm
model counts it, ``comm_model``). The shard itself is what the module's norm produced and is
otherwise freed, so a block holds one shard instead of tp.

The all-gather is issued ahead of its use, as Megatron overlaps it with the input-gradient
GEMM: at the first unpack of anything else the module saved (the other saved tensors pass
through the same hooks unchanged), which is its last linear's backward (attention's output
projection, a feed-forward's w2), so the gather runs while that linear's and the ops before
it run their backward (attention's: the whole fused attention backward) and the first
column-parallel linear waits for it (``async_op``: on NCCL the collective's stream). The
gathered input is then held from that unpack to the column-parallel linears' backward.

Why hooks and not torch: no torch ParallelStyle saves the shard, and a custom linear would
replace the job's linears (float8's among them). It applies where sequence parallel gathers
and nothing else packs the module's saved tensors (``saves_shard``): TP with sequence
parallel, no activation checkpoint around the block (``parallel.ac`` none, moe or moe_act: full and
selective recompute or keep what their own rule says); compile and float8 are refused
(``config.checks``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import PrepareModuleInput

from hsdp_runner.config.schema import ParallelConfig
from hsdp_runner.core.choices import AC


def saves_unpacked(parallel: ParallelConfig) -> bool:
    """Whether nothing else packs what a block's attention saves in a job of ``parallel``:
    no activation checkpoint around it (``parallel.ac`` none, moe or moe_act) and no compile. Saved-
    tensor hooks of the runner's own (these, ``context_parallel._SharedOutput``) apply then."""
    return not AC(parallel.ac).wraps_blocks and not parallel.compile


def saves_shard(parallel: ParallelConfig) -> bool:
    """Whether a job of ``parallel`` with TP (the caller knows its degree:
    ``parallel.tp`` may be -1, or the planner's default) saves sequence parallel's gathered
    inputs as shards: ``sp_save_shard`` with sequence parallel where ``saves_unpacked``."""
    return bool(parallel.sp_save_shard and parallel.sequence_parallel and saves_unpacked(parallel))


class _ShardSaves:
    """One module's forward: its input shard, the gathered input, and the regathered copy
    backward shares between the module's linears."""

    def __init__(self, shard: DTensor):
        self.shard = shard
        self.gathered: int | None = None  # the gathered input's storage (``_memory``)
        self.packed = 0
        self.unpacked = 0
        self.again: torch.Tensor | None = None
        self.early = False  # the gather was started by another saved tensor's unpack

    def pack(self, saved: torch.Tensor):
        """Autograd's pack hook: the gathered input's views become a note; the rest is kept as
        it is, beside the note that its unpack starts the gather (``_Kept``)."""
        local = saved._local_tensor if isinstance(saved, DTensor) else saved
        if self.gathered is None or _memory(local) != self.gathered:
            return _Kept(self, saved)
        self.packed += 1
        spec = saved._spec if isinstance(saved, DTensor) else None
        return (self, local.size(), local.stride(), local.storage_offset(), spec)

    def prefetch(self, early: bool = False) -> None:
        """Start the all-gather of the shard (not waited for: its first use waits) unless it
        is under way or no view of it is left to unpack; ``early``: started by the unpack of
        another tensor the module saved."""
        if self.again is None and self.unpacked < self.packed:
            with torch.no_grad():
                gathered = self.shard.redistribute(placements=[Replicate()], async_op=True)
                self.again = gathered.to_local()
            self.early = early

    def regathered(self) -> torch.Tensor:
        """The gathered input's local tensor again: all-gathered at the first unpack (or
        before it, ``prefetch``), dropped after the last."""
        self.prefetch()
        self.unpacked += 1
        again = self.again
        if self.unpacked == self.packed:
            self.again = None
        return again


class _Kept:
    """A tensor the module saved that is not the gathered input, with the module's saves:
    its unpack (the module's backward has begun) starts the gather."""

    __slots__ = ("saves", "tensor")

    def __init__(self, saves: _ShardSaves, tensor: torch.Tensor):
        self.saves, self.tensor = saves, tensor


def _memory(tensor: torch.Tensor) -> int:
    """Which storage ``tensor`` lies in: its storage's C++ object (a view and the matmul's
    ``_unsafe_view`` of the input share it; ``Tensor._base`` misses the latter). Fake tensors
    have no data pointer to compare (the planner's measured step)."""
    return tensor.untyped_storage()._cdata


def _unpack(packed):
    if isinstance(packed, _Kept):
        packed.saves.prefetch(early=True)
        return packed.tensor
    saves, size, stride, offset, spec = packed
    local = saves.regathered().as_strided(size, stride, offset)
    if spec is None:
        return local
    return DTensor(local, spec, requires_grad=False)


def save_input_shard(module: nn.Module) -> None:
    """Make ``module`` (a block's attention or dense feed-forward, after its TP plan) save its
    sequence-sharded input's shard in place of the gathered input (module docstring)."""
    state: dict = {}

    def before_gather(mod, args):
        state["saves"] = _ShardSaves(args[0])

    def after_gather(mod, args):
        saves = state["saves"]
        gathered = args[0]
        saves.gathered = _memory(
            gathered._local_tensor if isinstance(gathered, DTensor) else gathered
        )
        state["hooks"] = torch.autograd.graph.saved_tensors_hooks(saves.pack, _unpack)
        state["hooks"].__enter__()

    def after_forward(mod, args, output):
        # Also after a forward that raised (``always_call``), which may not have got this far.
        hooks, saves = state.pop("hooks", None), state.pop("saves", None)
        if hooks is not None:
            hooks.__exit__(None, None, None)
        if saves is not None:
            saves.gathered = None  # the packed notes keep the shard, not the input
        return output

    # Ahead of the TP plan's input hook (which gathers), and after it.
    module.register_forward_pre_hook(before_gather, prepend=True)
    module.register_forward_pre_hook(after_gather)
    module.register_forward_hook(after_forward, always_call=True)


class PrepareInputSavingShard(PrepareModuleInput):
    """torch's ``PrepareModuleInput`` (the TP plans' gather of a block's attention and dense
    feed-forward input) whose module also saves that input as the rank's shard
    (``save_input_shard``): the ``prepare_input`` style ``parallelize.apply_tp`` hands the
    plans under ``parallel.sp_save_shard``."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        save_input_shard(module)
        return module
