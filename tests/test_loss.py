"""The training loss taken in chunks of tokens (``train/loss.py``, ``trainer.chunked_loss``):
the same loss and gradients as one cross-entropy, with a fraction of its tensor memory."""

import pytest
import torch

from hsdp_runner.train.loss import CHUNK_ELEMENTS, next_token_loss, trainer_loss
from hsdp_runner.train.tensor_memory import TensorMemoryMeter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_give_the_loss_and_gradients_of_one_cross_entropy(dtype):
    torch.manual_seed(0)
    logits = torch.randn(3, 50, 37, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 37, (3, 50))
    whole = next_token_loss(logits, targets)
    (whole_grad,) = torch.autograd.grad(whole, logits)
    # 41 tokens a chunk: three full chunks and an uneven last one.
    chunked = next_token_loss(logits, targets, chunk_elements=37 * 41 + 5)
    (chunked_grad,) = torch.autograd.grad(chunked, logits)
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.equal(chunked_grad, whole_grad)
    assert 3 * 50 * 37 <= CHUNK_ELEMENTS  # a tiny model's logits take the one-call path
    # trainer.chunked_loss picks the chunk size; off (the default), no limit.
    assert trainer_loss(True).keywords == {"chunk_elements": CHUNK_ELEMENTS}
    assert trainer_loss(False).keywords == {"chunk_elements": None}


def _peak_gib(chunk_elements: int) -> float:
    """Tensor memory a bf16 loss of 4,096 tokens x 4,096 vocabulary adds through its
    backward, its logits (32 MiB) already there."""
    torch.manual_seed(0)
    logits = torch.randn(4, 1024, 4096, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 4096, (4, 1024))
    meter = TensorMemoryMeter(torch.device("cpu"), steps=1)
    meter.start()
    next_token_loss(logits, targets, chunk_elements).backward()
    return meter.stop()


def test_chunks_hold_a_fraction_of_one_cross_entropys_memory():
    """One call holds the fp32 copy and log-probabilities (2 x 64 MiB) and in backward their
    fp32 gradient; chunks of 256 tokens hold the logits' bf16 gradient (32 MiB) and one
    chunk's fp32 work (4 MiB each)."""
    whole = _peak_gib(chunk_elements=1 << 30)
    chunked = _peak_gib(chunk_elements=256 * 4096)
    assert whole > 0.15 and chunked < 0.4 * whole, (whole, chunked)
