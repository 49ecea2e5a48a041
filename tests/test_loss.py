"""The training loss taken in chunks of tokens (``train/loss.py``, ``trainer.chunked_loss``):
the same loss and gradients as one cross-entropy, with a fraction of its tensor memory."""

import pytest
import torch
from distributed import run_workers

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


def _sharded_whole_and_chunked() -> tuple[float, float, float, int]:
    """On each of 2 ranks: the loss of (3, 50, 38) logits sharded over the vocabulary, whole
    through torch's ``loss_parallel`` and with a limit of 19 x 41 + 5 logits a rank (chunks of
    41 tokens); returns (whole loss, chunked loss, largest difference of this rank's logit
    gradients, chunks the second loss's forward took)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hsdp_runner.train import loss as loss_module

    chunks = []
    summed = loss_module._summed_loss
    loss_module._summed_loss = lambda *args: chunks.append(1) or summed(*args)
    torch.manual_seed(0)  # the same logits and targets on both ranks
    full = torch.randn(3, 50, 38, dtype=torch.bfloat16)
    targets = torch.randint(0, 38, (3, 50))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = []
    with loss_module.loss_context(True):
        for chunk_elements in (None, 19 * 41 + 5):
            logits = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
            loss = next_token_loss(logits, targets, chunk_elements)
            forward_chunks = len(chunks)
            loss.backward()
            out.append((loss.item(), logits.grad.to_local().float()))
    (whole, whole_grad), (chunked, chunked_grad) = out
    return whole, chunked, (whole_grad - chunked_grad).abs().max().item(), forward_chunks


@pytest.mark.multiprocess
def test_vocabulary_sharded_logits_in_chunks_give_the_loss_and_gradients_of_loss_parallel():
    """Under loss parallel the limit holds for a rank's slice of the vocabulary, and each chunk
    of tokens goes through torch's ``loss_parallel``: the same loss to fp32 rounding and the
    same gradients as one call over all the tokens."""
    for whole, chunked, grad_diff, chunks in run_workers(_sharded_whole_and_chunked, 2).values():
        assert chunks == 4  # 150 tokens: three chunks of 41 and one of 27
        assert chunked == pytest.approx(whole, rel=1e-6)
        assert grad_diff == 0.0
