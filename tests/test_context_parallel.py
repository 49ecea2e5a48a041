"""Context parallel's pieces against the single-process computation: the head-tail order, the
data each cp rank receives, and the all-gather-K/V attention (forward and gradients) on 2 and
4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from omegaconf import OmegaConf

from hsdp_runner.distributed.context_parallel import (
    SequenceShard,
    head_tail_positions,
    shard_sequence,
)
from hsdp_runner.models.common import causal_attention
from hsdp_runner.train.data import TokenBatches


def test_head_tail_order_gives_each_rank_a_chunk_from_each_end():
    assert head_tail_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert head_tail_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4):
        every = torch.cat([head_tail_positions(32, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(32))
        # Equal causal work: the number of (query, key) pairs a rank's queries attend to.
        work = {int((head_tail_positions(32, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1, work


def test_each_cp_rank_receives_its_positions_of_inputs_and_targets():
    data = OmegaConf.create({"kind": "synthetic", "path": None})
    whole = TokenBatches(data, 64, 16, 4, dp_rank=1, dp_size=2, seed=3)
    inputs, targets = whole.local_batch(5)
    for rank in range(2):
        part = TokenBatches(data, 64, 16, 4, dp_rank=1, dp_size=2, seed=3, cp_rank=rank, cp_size=2)
        x, y = part.local_batch(5)
        index = head_tail_positions(16, 2, rank)
        assert torch.equal(x, inputs[:, index]) and torch.equal(y, targets[:, index])
        assert torch.equal(shard_sequence(inputs, 2, rank), x)


def _attention_against_full() -> dict:
    """On 4 ranks: cp = 4 over all of them, then cp = 2 in two groups of two, in fp32 and bf16.
    Returns per (cp, dtype) the largest differences from full attention in one process
    (output and the gradients of q, k and v, each rank comparing its own positions) and the
    elements of the largest storage autograd saved (the whole sequence's keys or values)."""
    from torch.distributed.device_mesh import init_device_mesh

    errors = {}
    for cp, shape, names in ((4, (4,), ("cp",)), (2, (2, 2), ("dp", "cp"))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)["cp"]
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(cp)  # the same tensors on every rank
            q, grad = (torch.randn(2, 4, 16, 8, generator=gen).to(dtype) for _ in range(2))
            k, v = (torch.randn(2, 2, 16, 8, generator=gen).to(dtype) for _ in range(2))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            reference = causal_attention(*full)
            (reference * grad).sum().backward()
            index = head_tail_positions(16, cp, mesh.get_local_rank())
            mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
            saved = []  # the elements of each saved tensor's storage

            def keep(t: torch.Tensor, saved=saved) -> torch.Tensor:
                saved.append(t.untyped_storage().nbytes() // t.itemsize)
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                out = SequenceShard(mesh, 16).attention(*mine)
            (out * grad[:, :, index]).sum().backward()
            errors[cp, str(dtype)] = (
                [float((out - reference[:, :, index]).abs().max())]
                + [float((m.grad - f.grad[:, :, index]).abs().max()) for m, f in zip(mine, full)]
                + [max(saved)]
            )
    return errors


@pytest.mark.multiprocess
def test_all_gather_kv_attention_equals_full_attention_on_2_and_4_ranks():
    """In bf16 the gathered keys and values are saved with their 2 heads (2 x 2 x 16 x 8
    elements), not repeated to the queries' 4 (in fp32 they are, as plain attention repeats
    them: ``common.grouped_kv``)."""
    results = run_workers(_attention_against_full, 4)
    for rank, errors in results.items():
        for (cp, dtype), (out, dq, dk, dv, largest) in errors.items():
            fp32 = dtype == "torch.float32"
            assert max(out, dq, dk, dv) < (1e-5 if fp32 else 3e-2), (rank, cp, errors[cp, dtype])
            assert largest == 2 * (4 if fp32 else 2) * 16 * 8, (rank, cp, dtype, largest)
