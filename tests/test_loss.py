"""The training loss (``train/loss.py``) taken in chunks of tokens (``trainer.chunked_loss``):
the same loss and gradients as one cross-entropy, with a fraction of its tensor memory; and in
the logits' own dtype (``trainer.loss_fp32=false``): the fp32 loss to bf16's rounding, with half
its memory."""

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
    assert trainer_loss(True).keywords == {"chunk_elements": CHUNK_ELEMENTS, "fp32": True}
    assert trainer_loss(False, False).keywords == {"chunk_elements": None, "fp32": False}


def test_a_loss_in_the_logits_dtype_is_the_fp32_loss_to_bf16_rounding():
    """``fp32=False`` on bf16 logits: the log-softmax in bf16, each token's loss reduced in
    fp32, so the mean is not rounded to bf16 (0.06 at a loss of 9); in chunks the same loss
    and gradients as in one call."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50, 37, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 37, (3, 50))
    grads = {}
    for fp32, chunk_elements in ((True, None), (False, None), (False, 37 * 41 + 5)):
        loss = next_token_loss(logits, targets, chunk_elements, fp32=fp32)
        assert loss.dtype == torch.float32
        (grads[fp32, chunk_elements],) = torch.autograd.grad(loss, logits)
        grads[fp32, chunk_elements, "loss"] = loss.item()
    assert grads[False, None, "loss"] == pytest.approx(grads[True, None, "loss"], rel=1e-3)
    assert grads[False, None, "loss"] != grads[True, None, "loss"]  # computed in bf16
    scale = grads[True, None].abs().max()
    assert (grads[False, None] - grads[True, None]).abs().max() < 0.02 * scale
    chunked = grads[False, 37 * 41 + 5, "loss"]
    assert chunked == pytest.approx(grads[False, None, "loss"], rel=1e-6)
    assert torch.equal(grads[False, 37 * 41 + 5], grads[False, None])


def _peak_gib(chunk_elements: int, fp32: bool = True) -> float:
    """Tensor memory a bf16 loss of 4,096 tokens x 4,096 vocabulary adds through its
    backward, its logits (32 MiB) already there."""
    torch.manual_seed(0)
    logits = torch.randn(4, 1024, 4096, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 4096, (4, 1024))
    meter = TensorMemoryMeter(torch.device("cpu"), steps=1)
    meter.start()
    next_token_loss(logits, targets, chunk_elements, fp32).backward()
    return meter.stop()


def test_chunks_and_the_logits_dtype_hold_a_fraction_of_one_fp32_cross_entropys_memory():
    """One fp32 call holds the fp32 copy and log-probabilities (2 x 64 MiB) and in backward
    their fp32 gradient (three of 64 MiB at backward's peak: the log-probabilities, their
    gradient and the copy's); chunks of 256 tokens hold the logits' bf16 gradient (32 MiB)
    and one chunk's fp32 work (4 MiB each); one call in bf16 (``fp32=False``) holds the same
    three in bf16: half the fp32 call's."""
    whole = _peak_gib(chunk_elements=1 << 30)
    chunked = _peak_gib(chunk_elements=256 * 4096)
    in_bf16 = _peak_gib(chunk_elements=1 << 30, fp32=False)
    assert whole > 0.15 and chunked < 0.4 * whole, (whole, chunked)
    assert in_bf16 == pytest.approx(whole / 2, rel=0.01), (whole, in_bf16)


def _sharded_whole_and_chunked() -> tuple[float, float, float, int]:
    """On each of 2 ranks: the loss of (3, 50, 38) logits sharded over the vocabulary, whole
    through torch's ``loss_parallel`` and with a limit of 19 x 41 + 5 logits a rank (chunks of
    41 tokens); returns (whole loss, chunked loss, largest difference of this rank's logit
    gradients, chunks the second loss's forward took, the whole loss in bf16)."""
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
        in_bf16 = next_token_loss(distribute_tensor(full, mesh, [Shard(2)]), targets, fp32=False)
    (whole, whole_grad), (chunked, chunked_grad) = out
    diff = (whole_grad - chunked_grad).abs().max().item()
    return whole, chunked, diff, forward_chunks, in_bf16.item()


@pytest.mark.multiprocess
def test_vocabulary_sharded_logits_in_chunks_give_the_loss_and_gradients_of_loss_parallel():
    """Under loss parallel the limit holds for a rank's slice of the vocabulary, and each chunk
    of tokens goes through torch's ``loss_parallel``: the same loss to fp32 rounding and the
    same gradients as one call over all the tokens; in the logits' bf16 the same loss to
    bf16's rounding."""
    ranks = run_workers(_sharded_whole_and_chunked, 2).values()
    for whole, chunked, grad_diff, chunks, in_bf16 in ranks:
        assert chunks == 4  # 150 tokens: three chunks of 41 and one of 27
        assert chunked == pytest.approx(whole, rel=1e-6)
        assert grad_diff == 0.0
        assert in_bf16 == pytest.approx(whole, rel=1e-3) and in_bf16 != whole
