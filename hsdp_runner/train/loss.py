"""The training loss: mean next-token cross-entropy, on whole logits or on logits sharded over
the vocabulary (``parallel.loss_parallel`` with tp > 1: the output layer leaves them a DTensor,
``models/common.output_layer_style``).

Sharded logits go through torch's ``loss_parallel``: its log-softmax and NLL all-reduce three
fp32 numbers per token over the TP group (the row max, the sum of exponentials and the target's
logit) instead of all-gathering tokens x vocabulary logits, and no TP rank ever holds the whole
vocabulary's fp32 log-probabilities. torch requires the backward to run inside the same context
as the loss (``loss_context``), so the trainer holds it around a step's forward and backward
(a pipeline schedule's too), the planner's memory measurement likewise.

With ``trainer.chunked_loss`` (``trainer_loss``), a rank's logits larger than
``CHUNK_ELEMENTS`` (whole, or its slice of the vocabulary under loss parallel) are taken in
chunks of tokens, each chunk's fp32
log-softmax recomputed in backward (``torch.utils.checkpoint``): one cross-entropy over all of
them would hold the fp32 copy of every logit and its log-probabilities (4 + 4 bytes per
logit) in forward and the log-probabilities and their fp32 gradient in backward, where the
chunks hold the logits as they are (2 bytes in bf16) and one chunk's fp32 work at a time.
For Qwen3's 151,936-token vocabulary at 16,384 tokens a rank (4 x 4,096) that is about 20 GB
of a step's peak against about 5 GB plus a chunk. torch's ``loss_parallel`` holds as much per
vocabulary slice (its fp32 log-probabilities and backward's fp32 temporaries: 9.3 GiB at the
peak on top of the 1.2 GiB of bf16 logits, for 16,384 tokens x a quarter of that vocabulary,
against 2.3 GiB in chunks; measured on fake tensors), so sharded logits are chunked the same
way, each chunk through ``loss_parallel``. Taken in chunks, the loss is the same sum in another order (fp32 rounding,
~1e-7 relative), and the gradients are the same. Off by default, as torchtitan's loss (whose
published memory figures the planner is checked on).

With ``trainer.loss_fp32=false`` the cross-entropy runs in the logits' own dtype (bf16 under
the bf16 policies), as NeMo AutoModel's ``MaskedCrossEntropy(fp32_upcast=False)``: no fp32
copy of the logits, and the log-probabilities and their gradient at 2 bytes a logit instead
of 4 (half the loss's peak), at bf16's rounding of the log-probabilities: each token's loss
to about 2^-9 relative (reduced over the tokens in fp32, so the mean is not rounded again;
``tests/test_loss.py``: 5e-5 relative over 150 tokens) and the logits' gradient, which
backward's softmax recomputes from them, to about 1e-2. fp32 (true) by default."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def loss_parallel_on(loss_parallel: bool, tp: int) -> bool:
    """Whether the loss runs on vocabulary-sharded logits: ``parallel.loss_parallel`` and a
    TP degree ``tp`` above 1."""
    return loss_parallel and tp > 1


def loss_context(enabled: bool):
    """torch's ``loss_parallel`` context when ``enabled`` (the loss and its backward on
    vocabulary-sharded logits), else a context that does nothing. Not reentrant: hold one
    around everything that computes or differentiates the loss."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


# Whole logits (tokens x vocabulary) above this many elements are taken in chunks of tokens:
# a chunk's fp32 work is then at most 2 x 4 x CHUNK_ELEMENTS bytes (512 MiB).
CHUNK_ELEMENTS = 1 << 26


def trainer_loss(chunked: bool, fp32: bool = True):
    """The job's loss function ``(logits, targets) -> mean loss``: ``next_token_loss``, in
    chunks of ``CHUNK_ELEMENTS`` logits where ``chunked`` (``trainer.chunked_loss``), in fp32
    where ``fp32`` (``trainer.loss_fp32``), else in the logits' dtype."""
    return functools.partial(
        next_token_loss, chunk_elements=CHUNK_ELEMENTS if chunked else None, fp32=fp32
    )


def next_token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    chunk_elements: int | None = None,
    fp32: bool = True,
) -> torch.Tensor:
    """Mean next-token cross-entropy of (batch, seq, vocab) ``logits`` over ``targets``
    (batch, seq), computed in fp32 where ``fp32``, else in the logits' dtype. Logits sharded
    over the vocabulary (a DTensor) need ``loss_context(True)`` around this call and the
    backward. Whole logits of more than ``chunk_elements`` elements (None: no limit) are
    taken in chunks of tokens, each recomputed in backward (module docstring). Returns a
    plain fp32 0-dim tensor."""
    flat, flat_targets = logits.flatten(0, 1), targets.flatten()
    # A rank's part: under loss parallel its slice of the vocabulary.
    local = flat.to_local() if isinstance(flat, DTensor) else flat
    if chunk_elements is None or local.numel() <= chunk_elements:
        loss = _cross_entropy(flat, flat_targets, fp32, "mean")
    else:
        from torch.utils.checkpoint import checkpoint

        rows = max(1, chunk_elements // local.shape[-1])
        total = sum(
            checkpoint(_summed_loss, part, part_targets, fp32, use_reentrant=False)
            for part, part_targets in zip(flat.split(rows), flat_targets.split(rows))
        )
        loss = total / flat_targets.numel()
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _summed_loss(logits: torch.Tensor, targets: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """Summed cross-entropy of (tokens, vocab) ``logits`` (one chunk), computed in fp32 where
    ``fp32``, else in the logits' dtype."""
    return _cross_entropy(logits, targets, fp32, "sum")


def _cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, fp32: bool, reduction: str
) -> torch.Tensor:
    """Cross-entropy of (tokens, vocab) ``logits``, ``reduction`` 'mean' or 'sum', returned in
    fp32: on an fp32 copy of the logits where ``fp32``, else in their own dtype, each token's
    loss then reduced in fp32 (a bf16 mean of thousands of tokens would round the loss to
    bf16's 2^-8: 0.06 at a loss of 9)."""
    if fp32:
        return F.cross_entropy(logits.float(), targets, reduction=reduction)
    per_token = F.cross_entropy(logits, targets, reduction="none").float()
    return per_token.sum() if reduction == "sum" else per_token.mean()
