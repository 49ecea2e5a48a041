"""A layout's memory per rank from a measurement of the job's step (``planner.memory``): the
exact training state of its degrees, the measured phases rescaled to its shards, and the
optimizer step, in GiB.

A measurement is taken on one layout and reused by every layout with the same tp, cp, ep,
micro-batch and data-parallel wrapper (``planner.layouts``); what differs between them is the
shard of the parameters and gradients each rank keeps, which is exact arithmetic
(``param_sizes.view_sizes``, each part over its own group), and AdamW's moments, added to every
phase (held through every step after the first).
"""

from __future__ import annotations

from hsdp_runner.planner.mem_phases import MOMENTS, phase_name

GIB = 2**30


def state_bytes(views: dict, dims, master_bytes: int) -> dict:
    """Exact per-rank bytes of sharded parameters, gradients and AdamW's two moments.

    ``views``: ``param_sizes.view_sizes`` ((all, trainable) elements of what one rank holds
    before sharding, padded as FSDP pads, per group it shards over), each divided here by its
    group's size in ``dims`` (``ParallelDims.group_size``: ``dp_shard x cp`` for the dense
    parameters, ``efsdp`` for the experts)."""
    params = sum(sizes[0] // dims.group_size(view) for view, sizes in views.items())
    grads = sum(sizes[1] // dims.group_size(view) for view, sizes in views.items())
    params, grads = params * master_bytes, grads * master_bytes
    return {"params": params, "grads": grads, "optimizer": 2 * grads}


# The phases of the output layer and the loss: only the last pipeline stage runs them.
HEAD_PHASES = ("fw:head", "loss", "loss_bw", "bw:head")


def layout_memory(
    phases: dict[str, dict],
    measured_state: dict,
    state: dict,
    reserve_gib: float,
    n_layers: int,
    accum: int,
) -> dict:
    """Per-rank memory of a layout in GiB: the peak, the phase it falls in and its parts.

    ``phases``: per phase of the step, the tracker's categories at that phase's largest moment,
    extrapolated to the model's depth (``mem_phases.extrapolate``), for the layout the
    measurement was taken on (``measured_state`` its exact state); ``state``: this layout's
    exact state. Sharded parameters and gradients are rescaled from one to the other, AdamW's
    moments (live through every step after the first) are added to every phase, and the
    optimizer step is one more phase: everything but activations, plus one shard-sized
    temporary. ``phase_gib`` lists every phase by name.

    For pipeline stages (``planner.pipeline``) it also gives ``saved_activations_gib``, what
    one micro-batch's forward leaves held through the blocks (measured when the final norm
    starts), ``forward_held_gib``, what its forward and loss leave (the logits included: a
    pipeline stage keeps its output until its backward), and ``peak_without_head_gib``, the peak over
    every phase but the output layer's and the loss's (a stage without the output layer peaks
    there).
    """
    scale_p = state["params"] / measured_state["params"] if measured_state["params"] else 1.0
    scale_g = state["grads"] / measured_state["grads"] if measured_state["grads"] else 1.0

    def total(cats: dict) -> float:
        transient = sum(
            v for k, v in cats.items() if k not in ("sharded_param", "sharded_grad", "total")
        )
        return (
            cats.get("sharded_param", 0) * scale_p
            + cats.get("sharded_grad", 0) * scale_g
            + transient
            + state["optimizer"]
        )

    moments = {k.split("/")[1]: c for k, c in phases.items() if k in {f"0/{m}" for m in MOMENTS}}
    phases = {k: c for k, c in phases.items() if k.split("/")[1] not in MOMENTS}
    named = {phase_name(k, n_layers, accum): (total(c), c) for k, c in phases.items()}
    buffers = max((c.get("buffer", 0) for c in phases.values()), default=0)
    optimizer = state["params"] + 2 * state["grads"] + state["optimizer"] + buffers
    named["optimizer step"] = (optimizer, {})
    peak_name = max(named, key=lambda n: named[n][0])
    peak, cats = named[peak_name]
    without_head = max(
        [total(c) for k, c in phases.items() if k.split("/")[1] not in HEAD_PHASES] + [optimizer]
    )
    # What one micro-batch leaves held (``mem_phases.MOMENTS``): through the blocks' forward,
    # and through its loss with the logits still referenced.
    saved = moments.get("at:blocks_end", {}).get("act", 0)
    forward_held = moments.get("at:loss_end", {}).get("act", 0)
    return {
        "peak_gib": (peak + reserve_gib * GIB) / GIB,
        "peak_phase": peak_name,
        "params_gib": state["params"] / GIB,
        "grads_gib": state["grads"] / GIB,
        "optimizer_gib": state["optimizer"] / GIB,
        "activations_gib": cats.get("act", 0) / GIB,
        "unsharded_params_gib": (cats.get("unsharded_param", 0) + cats.get("unsharded_grad", 0))
        / GIB,
        "temp_gib": (
            cats.get("temp", 0) + cats.get("all_gather", 0) + cats.get("reduce_scatter", 0)
        )
        / GIB,
        "reserve_gib": reserve_gib,
        "phase_gib": {n: round((v + reserve_gib * GIB) / GIB, 3) for n, (v, _) in named.items()},
        "saved_activations_gib": saved / GIB,
        "forward_held_gib": forward_held / GIB,
        "peak_without_head_gib": (without_head + reserve_gib * GIB) / GIB,
    }
