"""Memory per rank of a layout, measured on the runner's own model and sharding applier.

No device and no memory is used: a child process joins a *fake* process group of the target
world size (``FakeStore``), builds the world mesh with ``ParallelDims.build_mesh``, builds the
configured model with the job's own build (``parallelize.parallelized_meta_model``: float8
conversion, TP, cp, AC, compile and data parallel, all as a job applies them), materialises it
under ``FakeTensorMode`` and runs one training step's forward and backward (the trainer's loss,
its micro-batches and the job's gradient-sync switch, ``parallelize.set_gradient_sync``)
inside torch's ``FSDPMemTracker``, which counts live
bytes per category: sharded and unsharded parameters, gradients, activations, temporaries,
all-gather and reduce-scatter buffers. ``mem_phases.PhaseRecorder`` keeps, per phase of the
step, the categories at that phase's largest moment. The child keeps the fake group and fake
tensors out of the caller's process.

Gradient accumulation runs two micro-batches (more add nothing: each but the last looks like the
second), reducing gradients as the trainer does for ``trainer.accum_reduce``: with ``every``
FSDP and HSDP reduce-scatter each micro-batch (gradient shards cross micro-batches); with
``last``, and always for DDP, sync is off until the last, so FSDP2 keeps every unsharded
gradient (in the reduce dtype) through the next micro-batch.

Three things are worked out instead of measured, and said so in the plan:
- **Depth.** Only ``plan.layers_measured`` blocks (default 1 and 2) are built; each phase of
  the step grows linearly in the number of blocks, by a per-block growth that is measured
  (``mem_phases.extrapolate``), and the peak is the largest phase at the model's depth.
- **Shard size.** A measurement is reused by every layout with the same tp and cp degrees,
  micro-batch and data-parallel wrapper (whole parameters (DDP) or sharded (FSDP, HSDP)); the
  parts that scale with the shard (sharded parameters and gradients, over ``dp_shard x cp``)
  are rescaled to each layout's shard by exact arithmetic, FSDP's padding included
  (``comm_model.unit_sizes``).
- **Optimizer.** AdamW's two moments per trainable shard element, in the stored dtype, held
  through the whole step after the first; the optimizer step itself peaks at parameters +
  gradients + moments + one temporary of the shard size (foreach ``sqrt``).

What differs on a GPU: the fake step runs with the flash-attention backend forced
(``sdpa_kernel(FLASH_ATTENTION)``, on CPU ``_scaled_dot_product_flash_attention_for_cpu``), which
saves only the output and the log-sum-exp per row, as CUDA's flash kernel does, so no
seq x seq scores are counted, and for a GPU cluster context parallel's lower-right causal
attention saves no mask either (``cuda_causal_bias``; a CPU job holds that mask); the cluster's ``memory_reserve_gib`` adds the CUDA caching
allocator's slack above live tensors.

Context parallel: the measured step feeds each rank ``seq_len / cp`` tokens per sequence, as the
data loader does, so every activation of the blocks shrinks by cp; the model is parallelized by
the runner's own applier, so what cp adds on top (the keys and values of the whole sequence
gathered for attention) is measured as a job would hold it.

The step's loss is the trainer's (``train/loss.py``; on vocabulary-sharded logits under TP with
``parallel.loss_parallel``): the logits die with the loss call, so backward holds the saved
fp32 log-probabilities, and its first step adds two fp32 vocab-sized temporaries (each TP
rank's part of the vocabulary with loss parallel): for long sequences that moment is the peak. Selective AC is measured as the
runner applies it (``parallelize.selective_policy``: every other matmul output saved). Float8
layouts are measured as they run: the converted linears' weights gathered at one byte per
element (``precision.float8_all_gather``).

What is predicted is tensor memory, the figure CUDA's allocated peak measures; a job measures
the same on CPU with ``tensor_memory.TensorMemoryMeter``. What a CPU process holds beyond its
tensors (library code pages, Python objects, glibc's heap slack) is neither predicted nor
compared (docs/planner.md, "Memory on this machine").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from hsdp_runner.distributed.hardware import cache_dir
from hsdp_runner.planner.mem_phases import PhaseRecorder, categories

CACHE_VERSION = 22  # bump when what a measurement holds changes (5: phases and marks; 6:
# DTensor's shape inference untracked, ``_untracked_dtensor_meta``; 7: ``mem_phases.MOMENTS``;
# 8: the job's build, float8 conversion included; 9: the MoE layer saves its routed copies in
# their own dtype, ``moe_routing.WeightedCombine`` (gone since 21): a model with experts holds
# less; 10: RMSNorm
# and RoPE save no fp32 copies, ``norm_rope.RMSNormFunction`` and ``RopeFunction``: every model;
# 11: the experts' SwiGLU saves its two inputs only, ``moe_routing.SwiGLU``: a model with experts;
# 12: fp16/bf16 attention saves grouped-query keys and values un-repeated, ``common.grouped_kv``:
# a model with fewer key than query heads; 13: the blocks' RoPE tables reach them in fp32,
# uncast by FSDP, and RoPE's rotation built per call, ``RopeFunction``: every model with RoPE;
# 14: a rank's experts sharded on dim 1 where dim 0 would be padded,
# ``param_sizes.expert_shard_dim``: a model with fewer experts a rank than efsdp ranks; 15: a
# request carries ``trainer.chunked_loss``, the job's loss in chunks of tokens; 16: the flat
# token exchange in chunks, ``parallel.ep_chunks``: a model with experts under ep; 17: a
# request carries its device type, and a GPU's context-parallel attention saves no mask,
# ``cuda_causal_bias``; 18: ``trainer.chunked_loss`` takes vocabulary-sharded logits in chunks
# too, ``loss.next_token_loss``: a TP layout with loss parallel; 19: context parallel's two query
# chunks' attention outputs saved once, ``context_parallel._SharedOutput``: a cp layout; 20:
# ``trainer.loss_fp32`` in a request; 21: the experts weigh their outputs by the router,
# ``moe_routing.WeightedSwiGLU``, and the combine keeps none of them: a model with experts; 22:
# experts no other rank holds accumulate their gradients in no wider a dtype than the master
# weights, ``mixed_precision.mixed_precision_policy``: ep over all of a replica, bf16 master weights)
MAX_CHILDREN = max(1, min(2, os.cpu_count() or 1))
_POOL: ProcessPoolExecutor | None = None  # see _children
# How the measuring children start (``start_children_in``): spawned unless the caller has a
# server that imported torch already.
_START: dict = {"method": "spawn", "initializer": None, "initargs": ()}


def request(
    model: dict,
    parallel: dict,
    precision: dict,
    freeze: list,
    shape: tuple,
    micro_batch: int,
    accum: int,
    world_size: int,
    ranks_per_node: int,
    n_layers,
    *,
    accum_reduce: str,
    experts: dict | None = None,
    chunked_loss: bool = False,
    loss_fp32: bool = True,
    device_type: str = "cpu",
) -> dict:
    """Describe one fake measurement as a plain dict (what the child process needs):
    ``n_layers`` the blocks to build (a ``mem_phases.depth_key``: a count, or (dense, MoE)
    blocks of a model with experts), ``accum_reduce`` is ``trainer.accum_reduce``'s value,
    ``every`` or ``last``; ``experts`` for a model with experts: {'ep': degree, 'imbalance':
    ``plan.expert_imbalance``} (``expert_memory``); ``chunked_loss`` and ``loss_fp32`` are
    ``trainer.*``'s (the job's loss, ``loss.trainer_loss``); ``device_type`` the torch device
    type the planned job runs on (``Cluster.device_type``), whose attention kernels the step
    saves for (``cuda_causal_bias``)."""
    if isinstance(n_layers, int):
        blocks = {"n_layers": n_layers}
    else:
        blocks = {"n_layers": sum(n_layers), "n_dense_layers": n_layers[0]}
    extra = {"experts": dict(experts)} if experts is not None else {}
    return {
        "model": {**model, **blocks},
        "parallel": parallel,
        "precision": precision,
        "freeze": list(freeze),
        "shape": list(shape),
        "micro_batch": micro_batch,
        "accum": min(accum, 2),
        "accum_reduce": accum_reduce if accum > 1 else "every",  # one micro-batch: no choice
        "chunked_loss": chunked_loss,
        "loss_fp32": loss_fp32,
        "device_type": device_type,
        "world_size": world_size,
        "ranks_per_node": ranks_per_node,
        **extra,
        "v": CACHE_VERSION,
    }


def _key(req: dict) -> str:
    """The disk cache's name for ``req``'s measurement: its content, ``CACHE_VERSION`` among it,
    and the torch it is measured with (FSDP2's and DTensor's allocations are torch's, so an
    upgraded torch measures afresh)."""
    import torch

    keyed = {**req, "torch": torch.__version__}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:24]


def measure(requests: list[dict], use_disk_cache: bool = True) -> list[dict]:
    """Return, per request, the tracker's categories at the step's peak, in bytes.

    Results are cached on disk by the request's content (``memory/`` in
    ``hardware.cache_dir()``); the rest run in one spawned child process.
    """
    cache = cache_dir() / "memory"
    results: dict[int, dict] = {}
    todo = []
    for i, req in enumerate(requests):
        path = cache / f"{_key(req)}.json"
        if use_disk_cache and path.exists():
            results[i] = json.loads(path.read_text())
        else:
            todo.append(i)
    if todo:
        # One child per core, two at most (each pays ~3 s of imports and ~3 s of warm-up on
        # its first step, once: they are kept); a child keeps its fake process group per world
        # size, so the requests are dealt out in turn.
        workers = min(MAX_CHILDREN, len(todo))
        chunks = [todo[k::workers] for k in range(workers)]
        pool = _children()
        futures = [pool.submit(_measure_all, [requests[i] for i in c]) for c in chunks]
        done = {i: res for c, f in zip(chunks, futures) for i, res in zip(c, f.result())}
        fresh = [done[i] for i in todo]
        for i, res in zip(todo, fresh):
            results[i] = res
            if use_disk_cache:
                cache.mkdir(parents=True, exist_ok=True)
                (cache / f"{_key(requests[i])}.json").write_text(json.dumps(res))
    return [results[i] for i in range(len(requests))]


def start_children_in(method: str, initializer=None, initargs: tuple = ()) -> None:
    """Start the measuring children not yet started with multiprocessing start method
    ``method``, each running ``initializer(*initargs)`` first. The launcher hands over its
    forkserver this way (``runtime.forkserver``: torch and the runner imported once, the stop
    signals set back in each child by the initializer), so a child skips the ~3 s of imports a
    spawned one pays; the planner cannot start that server itself (it sits below the runtime)."""
    _START.update(method=method, initializer=initializer, initargs=tuple(initargs))


def _children() -> ProcessPoolExecutor:
    """The measuring child processes, started on first use (spawned, or forked from the server
    ``start_children_in`` named: the caller's threads and process groups stay out) and kept
    until ``release_children``, so that a plan that measures again (``parallel=auto`` planning
    its remedies when nothing fits) skips their start-up."""
    global _POOL
    if _POOL is None:
        _POOL = ProcessPoolExecutor(
            MAX_CHILDREN,
            mp_context=get_context(_START["method"]),
            initializer=_START["initializer"],
            initargs=_START["initargs"],
        )
    return _POOL


def release_children() -> None:
    """Stop the measuring child processes (a job does this before its workers start)."""
    global _POOL
    if _POOL is not None:
        _POOL.shutdown()
        _POOL = None


def _measure_all(requests: list[dict]) -> list[dict]:
    """Child process: every request in turn, each in a fake process group of its world size."""
    import warnings

    warnings.filterwarnings("ignore")
    _untracked_dtensor_meta()
    out = []
    for req in requests:
        _join(req["world_size"])
        out.append(_measure_one(req))
    return out


def _untracked_dtensor_meta() -> None:
    """Keep DTensor's shape inference out of the measurement (torch 2.13's private names).

    DTensor derives an op's output shape by running the op on fake tensors of the global
    shapes (``ShardingPropagator._propagate_tensor_meta_non_cached``), under the fake mode it
    finds active, else a fresh one. In a job that is a fresh mode no tracker sees; in this
    child it would be the child's own, under the tracker, which then counted those whole-size
    tensors as the rank's (a TP layout's output layer held the whole vocabulary's logits, its
    embedding the whole table: +128 MiB and +31 MiB at a 32k vocabulary, where the same step
    on real tensors holds neither). So here, too, it finds none and makes a fresh one."""
    from torch.distributed.tensor import _sharding_prop

    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None


_WORLD: int | None = None  # the child's fake process group's size, kept between calls


def _join(world_size: int) -> None:
    """Make the child's fake process group ``world_size`` ranks, reusing the one it has.

    DTensor caches its sharding decisions by mesh, and a mesh compares equal to the mesh of the
    same shape built on an earlier process group: a group destroyed and made again would be
    handed back the old mesh, whose collectives name the destroyed groups. So the group is kept
    for as long as the world size stays, and the caches are cleared when it changes.
    """
    global _WORLD
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if _WORLD == world_size and dist.is_initialized():
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_dtensor_caches()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    _WORLD = world_size


def _forget_dtensor_caches() -> None:
    """Clear DTensor's caches that hold meshes (torch 2.13's private names; see ``_join``)."""
    import torch
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    # The C++ dispatch fast path keeps a sharding cache of its own: left, a build whose group
    # names shifted (a model with experts creates more groups) met an earlier world's names.
    torch._C._clear_DTensor_sharding_propagator_cache()


def build_measured(req: dict):
    """The model one request measures, on the meta device, built by the job's own build
    (``parallelize.parallelized_meta_model``) on the world mesh of the request's degrees (pp = 1:
    the planner measures one stage's worth of blocks as a whole model); returns (model,
    ParallelDims, the model's config). Call in a process whose fake process group has the
    request's world size (``_join``). A model with experts gets its planned routing
    (``expert_memory.plan_routing``)."""
    import torch
    from omegaconf import OmegaConf

    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.parallelize import parallelized_meta_model
    from hsdp_runner.distributed.world_mesh import STAGE_DIMS
    from hsdp_runner.planner.expert_memory import lenient_grouped_mm_meta, plan_routing

    model_cfg, parallel = OmegaConf.create(req["model"]), OmegaConf.create(req["parallel"])
    precision = OmegaConf.create(req["precision"])
    experts = req.get("experts")
    degrees = {**dict(zip(STAGE_DIMS, req["shape"])), "ep": experts["ep"] if experts else 1}
    for name, degree in degrees.items():
        parallel[name] = degree
    parallel.pp = 1
    dims = ParallelDims(
        **degrees,
        world_size=req["world_size"],
        ranks_per_node=req["ranks_per_node"],
        moe=experts is not None,
    )
    world = dims.build_mesh("cpu")
    model = parallelized_meta_model(
        model_cfg, dims, world, parallel, precision, torch.device("cpu"), req["freeze"]
    )
    if experts is not None:
        lenient_grouped_mm_meta()
        plan_routing(model, experts["imbalance"])
    return model, dims, model_cfg


@contextlib.contextmanager
def cuda_causal_bias():
    """Within it, attention under torch's lower-right causal bias takes the branch CUDA takes.

    Context parallel's query chunks attend under that bias (``context_parallel``). On CPU
    torch's dispatch (``CausalBias._dispatch``, torch 2.13) materialises it as a queries x
    keys mask, which attention saves for backward: 1 GiB a block for 8K queries over 64K keys
    in bf16. On CUDA the flash (or memory-efficient) kernel takes the alignment as a flag and
    saves queries, keys, values, output and log-sum-exp only. Here the dispatch's flash check
    says yes, so the fake step of a GPU job calls the flash op, whose fake kernel saves what
    CUDA's does. Only for fake tensors: the op has no CPU kernel."""
    from torch.nn.attention import bias

    check = bias.can_use_flash_attention
    bias.can_use_flash_attention = lambda params, debug=False: True
    try:
        yield
    finally:
        bias.can_use_flash_attention = check


def _measure_one(req: dict, fake: bool = True) -> dict:
    """The tracked step of one request (module docstring), on fake tensors; ``fake=False``
    runs the same step on real ones (uninitialised memory, collectives of the fake process
    group doing nothing), which the tests compare it with. The step saves what the request's
    ``device_type`` saves (``cuda_causal_bias``; on real tensors, what a CPU saves)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hsdp_runner.core.choices import AccumReduce
    from hsdp_runner.distributed.parallelize import set_gradient_sync
    from hsdp_runner.train.loss import loss_context, loss_parallel_on, trainer_loss

    model, dims, model_cfg = build_measured(req)
    # Under context parallel a rank holds seq_len / cp tokens of each sequence (data.py).
    b, seq, accum = req["micro_batch"], model_cfg.seq_len // dims.cp, req["accum"]
    accum_reduce = AccumReduce(req["accum_reduce"])
    # The mesh's coordinate tensors are real; they meet fake tensors inside DTensor ops.
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        model.to_empty(device="cpu")
        tokens = torch.randint(0, model_cfg.vocab_size, (b, seq))
        if isinstance(model, FSDPModule):
            tracker = FSDPMemTracker(model)
            tracker.track_inputs((tokens,))
        else:  # TP alone in the stored dtype: no data-parallel wrapper to hook
            tracker = MemTracker()
            tracker.track_external(model, tokens)
        recorder = PhaseRecorder(tracker, model, model_cfg.n_layers)
        sharded_loss = loss_context(loss_parallel_on(req["parallel"]["loss_parallel"], dims.tp))
        on_gpu = fake and req["device_type"] == "cuda"
        bias = cuda_causal_bias() if on_gpu else contextlib.nullcontext()
        with tracker, sdpa_kernel([SDPBackend.FLASH_ATTENTION]), bias, sharded_loss:
            for micro in range(accum):
                if micro:
                    # The trackers refuse a second root forward as "another iteration" unless
                    # their per-module stats are cleared; the device-wide peak and the live
                    # tensors (gradients held across micro-batches) are kept.
                    tracker.reset_mod_stats()
                set_gradient_sync(model, dims, accum_reduce, micro == accum - 1)
                recorder.start_micro(micro)
                logits = model(tokens)
                recorder.mark("end_fw")
                # The trainer's loss; its logits die with the loss call, so backward holds
                # only what autograd saved (the fp32 log-probabilities), not the logits.
                loss = trainer_loss(req["chunked_loss"], req["loss_fp32"])(logits, tokens)
                recorder.moment("at:loss_end")
                del logits
                loss.backward()
                del loss
                recorder.mark("end_bw")
        peak = tracker.get_tracker_snapshot("peak")
    return {
        "peak": categories(next(iter(peak.values()))),
        "phases": recorder.phases,
        "marks": recorder.marks,
    }
