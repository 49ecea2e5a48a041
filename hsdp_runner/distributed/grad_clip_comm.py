"""What the gradient clip's total norm all-reduces in a step (``comm_model``'s clip term).

``train/grad_clip.clip_grad_norm`` takes one norm per mesh the rank's gradients live on (a
mixture of experts' experts and router sit on meshes of their own beside the dense weights'),
then the norm of those. On each mesh torch's ``get_total_norm`` keeps every gradient's norm
partial over the mesh dims the gradient is sharded on, stacks the norms (one per gradient, in
the master dtype) and ``full_tensor`` all-reduces the stack once over each such dim; a
replicated dim (HSDP's ``dp_replicate``, DDP) and plain tensors (pp alone) add nothing.
DTensor merges those all-reduces into one over a flattened view of the world mesh whose
groups are exactly the dims' joined (``_optimize_transform_infos``): the dense views never
join ``tp``, but a world with experts has ``dp_shard_cp_tp``, which joins FSDP's shard group
with ``tp``, and ``efsdp`` with ``ep``. A ``Partial`` gradient's own norm needs the gradient
whole: that all-reduce is TP's term in ``comm_model``.
"""

from __future__ import annotations

from collections import defaultdict

from hsdp_runner.config.schema import ParallelConfig, PrecisionConfig
from hsdp_runner.core.choices import DDPImpl, DPMode
from hsdp_runner.distributed.parallel_dims import EXPERT_VIEWS, VIEWS, ParallelDims
from hsdp_runner.distributed.param_sizes import local_params
from hsdp_runner.distributed.step_passes import has_dp_wrapper
from hsdp_runner.models.base import ModelConfig, build_meta_model
from hsdp_runner.models.params import frozen_names, torch_dtype


def clip_norm_comm(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    freeze=(),
    stages=(0,),
) -> list[tuple[str, int]]:
    """The clip's all-reduces in a step of a rank holding pipeline ``stages``: one
    ('all_reduce/<group>', bytes) per call, for the gradients ``clip_groups`` groups by mesh
    (``freeze``: ``trainer.freeze``'s patterns). The pipeline's sum over ``pp`` is
    ``comm_model``'s."""
    master = torch_dtype(precision.master_dtype).itemsize
    calls = []
    for count, sharded in clip_groups(model_cfg, dims, parallel, precision, freeze, stages):
        joined = _joining_view(dims, sharded) if len(sharded) > 1 else None
        calls += [
            (f"all_reduce/{name}", count * master) for name in ((joined,) if joined else sharded)
        ]
    return calls


def clip_groups(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    freeze=(),
    stages=(0,),
) -> list[tuple[int, tuple[str, ...]]]:
    """The gradients a rank holding pipeline ``stages`` clips (its trainable parameters, the
    ones ``freeze`` leaves out), grouped by the mesh they live on: per mesh, (how many
    gradients, the group names of the mesh dims they are sharded on, in mesh order; dims of
    one rank left out).

    A mesh is named by its dims' groups (``ParallelDims.same_group``, as the world mesh builds
    them): the dense weights' data-parallel mesh (``_dense_mesh``) with ``tp``, sharded on
    FSDP's dim and on ``tp`` when some weight TP splits is there; with the MoE layers' own
    wraps (``param_sizes.expert_wraps``; HSDP puts ``dp_replicate`` first) the experts'
    (``efsdp``, ``ep``) and the router's and shared experts' (``dp_shard_cp_tp``), sharded on
    each. Meshes with the same dims are one mesh (DeviceMesh equality), e.g. the router's and
    the dense weights' when ``dp_shard_cp_tp`` is ``dp_shard``."""
    frozen = set(frozen_names(dict(build_meta_model(model_cfg).named_parameters()), freeze))
    dense = _dense_mesh(dims, parallel, precision)
    replicate = ("dp_replicate",) if dims.dp_replicate > 1 else ()
    groups: dict[tuple[str, ...], list] = defaultdict(lambda: [0, set()])
    for stage in stages:
        for param in local_params(model_cfg, dims, parallel.sequence_parallel, stage):
            if param.name in frozen:
                continue
            if param.view == "dp_shard_cp":
                mesh = dense + (("tp",) if dims.tp > 1 else ())
                sharded = dense[-1:] if dims.dp_shard_cp > 1 else ()
                sharded += ("tp",) if param.split is not None else ()
            else:
                ep = (dims.same_group("ep"),) if param.experts and dims.ep > 1 else ()
                mesh = replicate + (dims.same_group(param.view),) + ep
                sharded = mesh[len(replicate) :]
            groups[mesh][0] += 1
            groups[mesh][1].update(name for name in sharded if dims.group_size(name) > 1)
    return [
        (count, tuple(name for name in mesh if name in sharded))
        for mesh, (count, sharded) in groups.items()
    ]


def _dense_mesh(
    dims: ParallelDims, parallel: ParallelConfig, precision: PrecisionConfig
) -> tuple[str, ...]:
    """The group names of the mesh the dense weights' data-parallel wrap puts them on
    (``parallelize.apply_data_parallel``; TP's dim comes after): FSDP's shard group, HSDP's
    (``dp_replicate``, shard group), DDP's ``dp_replicate`` (with ``dp_shard`` through
    ``parallel.ddp_impl=fully_shard``), none without data parallelism unless the precision
    needs the one-rank wrap over ``dp_shard``."""
    mode = dims.dp_mode
    if mode is DPMode.none:
        return ("dp_shard",) if has_dp_wrapper(dims, precision) else ()
    if mode is DPMode.ddp:
        extra = ("dp_shard",) if DDPImpl(parallel.ddp_impl) is DDPImpl.fully_shard else ()
        return ("dp_replicate",) + extra
    shard = (dims.same_group("dp_shard_cp"),)
    return (("dp_replicate",) if mode is DPMode.hsdp else ()) + shard


def _joining_view(dims: ParallelDims, names: tuple[str, ...]) -> str | None:
    """The flattened view of the world mesh whose groups are those of the groups ``names``
    joined, if the world mesh built one (``world_mesh.build_world_mesh`` flattens a view that
    no earlier name's group already is), else None."""
    wanted = _root_dims(dims, names)
    for view in (*VIEWS, *(EXPERT_VIEWS if dims.moe else ())):
        if dims.same_group(view) == view and _root_dims(dims, (view,)) == wanted:
            return view
    return None


def _root_dims(dims: ParallelDims, names) -> frozenset:
    """The world mesh dims (of more than one rank) the groups ``names`` span together; the
    expert split's ``efsdp`` and ``ep`` together span ``dp_shard_cp_tp``'s."""
    found = set()
    for name in names:
        if name in ("efsdp", "ep"):
            found.add(name)
        else:
            parts = {**VIEWS, **EXPERT_VIEWS}.get(name, (name,))
            found.update(dim for dim in parts if dims.group_size(dim) > 1)
    if {"efsdp", "ep"} <= found:
        found = (found - {"efsdp", "ep"}) | _root_dims(dims, ("dp_shard_cp_tp",))
    return frozenset(found)
