"""The training loss: mean next-token cross-entropy, on whole logits or on logits sharded over
the vocabulary (``parallel.loss_parallel`` with tp > 1: the output layer leaves them a DTensor,
``models/common.output_layer_style``).

Sharded logits go through torch's ``loss_parallel``: its log-softmax and NLL all-reduce three
fp32 numbers per token over the TP group (the row max, the sum of exponentials and the target's
logit) instead of all-gathering tokens x vocabulary logits, and no TP rank ever holds the whole
vocabulary's fp32 log-probabilities. torch requires the backward to run inside the same context
as the loss (``loss_context``), so the trainer holds it around a step's forward and backward
(a pipeline schedule's too), the planner's memory measurement likewise.
"""

from __future__ import annotations

import contextlib

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


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (in fp32) of (batch, seq, vocab) ``logits`` over
    ``targets`` (batch, seq). Logits sharded over the vocabulary (a DTensor) need
    ``loss_context(True)`` around this call and the backward. Returns a plain 0-dim tensor."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss.to_local() if isinstance(loss, DTensor) else loss
