"""The memory of a training step phase by phase, and its extrapolation to the model's depth.

A fake step's tracker reports one peak; at one or two blocks that peak is often another moment
of the step than at eighty (the loss's fp32 vocabulary-sized temporaries, or one block's
recompute, against eighty blocks' saved activations), so extrapolating the peak's parts from
shallow depths mixes unrelated moments. Instead the measuring child records, per **phase** of
the step, the tracker's categories at that phase's own largest moment (``PhaseRecorder``):

    per micro-batch: forward of the embedding, of the first block, of the last block, of the
    final norm and output; the loss; the loss backward; backward of the output, of the last
    block (the first one backward reaches), of the first block, of the embedding; what runs
    after backward (the last gradient reduction).

Inside one phase every other block is in one state: below the current point of the step
(forward done, its saved activations live) or above it (not run yet in forward; backward done
in backward, its gradients live). So each phase's live bytes are linear in depth, with a
per-block growth that is measured, not assumed, at three crisp moments of each micro-batch
(``marks``): its start (every block's sharded parameters, and gradients accumulated so far),
the end of its forward (plus every block's saved activations, and parameters kept unsharded
when ``reshard_after_forward`` is off) and the end of its backward (plus every block's
gradients, sharded or not as the reduction left them). ``extrapolate`` takes each phase at the
deepest measured depth and adds, per block more, the growth of that phase's kind; the step's
peak is the largest phase, and its name is reported. Interior blocks are not extrapolated: a
block with p blocks below and q above lies on the line between the first and the last block,
so it never exceeds both.
"""

from __future__ import annotations

import re

# Phase -> which growth per block applies: blocks still ahead in forward ("start"), blocks
# whose forward is done ("end_fw"), blocks whose backward is done ("end_bw").
PHASES = {
    "fw:embed": "start",
    "fw:first": "start",
    "fw:last": "end_fw",
    "fw:head": "end_fw",
    "loss": "end_fw",
    "loss_bw": "end_fw",
    "bw:head": "end_fw",
    "bw:last": "end_fw",
    "bw:first": "end_bw",
    "bw:embed": "end_bw",
    "bw:end": "end_bw",
}
INTERIOR = ("fw:mid", "bw:mid")  # measured, used only when the model is measured whole
# Moments, not phases (never a peak of their own): what a micro-batch leaves held when the
# blocks' forward is done (before the final norm), and when its loss is (the logits still
# referenced, as a pipeline stage keeps its output until its backward). A pipeline stage
# holds the first per micro-batch in flight, the last stage under GPipe the second
# (``planner.pipeline.stage_peak_gib``). Extrapolated as phases are.
MOMENTS = {"at:blocks_end": "end_fw", "at:loss_end": "end_fw"}
PHASES.update(MOMENTS)


class PhaseRecorder:
    """Wraps a torch memory tracker (``MemTracker`` or ``FSDPMemTracker``) so that after every
    op it also keeps, per phase of the step, the categories at that phase's largest total.

    ``model``: the tracked root (its ``blocks()`` give the block names); ``depth``: its number of
    blocks. Set ``micro`` before each micro-batch and call ``mark`` at its start, after its
    forward (``"end_fw"``) and after its backward (``"end_bw"``).
    """

    def __init__(self, tracker, model, depth: int) -> None:
        self.tracker, self.depth, self.micro = tracker, depth, 0
        self.phases: dict[str, dict] = {}
        self.marks: dict[str, dict] = {}
        container = next(n for n, m in model.named_children() if m is model.blocks())
        # The blocks are done when the first module after them (the final norm) starts.
        after_blocks = getattr(model, model.pipeline_ends()[1][0])
        after_blocks.register_forward_pre_hook(lambda *_: self.moment("at:blocks_end"))
        self._block = re.compile(rf"^[^.]+\.{re.escape(container)}\.(\d+)$")
        self._seen_blocks = {False: False, True: False}  # per direction, this micro-batch
        self._root_in_bw = False
        self._after_forward = False
        original = tracker._update_peak_stats

        def update(peak_state) -> None:
            original(peak_state)
            self._record()

        tracker._update_peak_stats = update

    def start_micro(self, micro: int) -> None:
        """Begin micro-batch ``micro`` (0-based): phases are recorded under its number."""
        self.micro = micro
        self._seen_blocks = {False: False, True: False}
        self._root_in_bw = self._after_forward = False
        self.mark("start")

    def mark(self, name: str) -> None:
        """Keep the tracker's current categories as ``<micro>/<name>``."""
        if name == "end_fw":
            self._after_forward = True
        self.marks[f"{self.micro}/{name}"] = self._snapshot()

    def moment(self, name: str) -> None:
        """Keep the current categories as the moment ``<micro>/<name>`` (``MOMENTS``), the
        first time it comes in the micro-batch (not again in a recompute)."""
        self.phases.setdefault(f"{self.micro}/{name}", self._snapshot())

    def _snapshot(self) -> dict:
        snap = self.tracker.get_tracker_snapshot()
        if not snap:
            return {"total": 0}
        return categories(next(iter(snap.values())))

    def _phases_now(self) -> list[str]:
        mods = self.tracker._mod_tracker
        backward = mods.is_bw
        blocks = [int(m.group(1)) for p in mods.parents if (m := self._block.match(p))]
        if blocks:
            self._seen_blocks[backward] = True
            # Two blocks are both listed for a moment where one hands over to the next: the
            # one the step is moving into counts.
            j = min(blocks) if backward else max(blocks)
            where = []
            if j == self.depth - 1:
                where.append("last")
            if j == 0:
                where.append("first")
            prefix = "bw:" if backward else "fw:"
            return [prefix + w for w in where] or [prefix + "mid"]
        inside_root = len(mods.parents) > 1
        if backward:
            if inside_root:
                self._root_in_bw = True
                return ["bw:embed" if self._seen_blocks[True] else "bw:head"]
            return ["bw:end" if self._root_in_bw else "loss_bw"]
        if inside_root:
            return ["fw:head" if self._seen_blocks[False] else "fw:embed"]
        return ["loss"] if self._after_forward else []

    def _record(self) -> None:
        phases = self._phases_now()
        if not phases:
            return
        snap = self.tracker._curr_mem_snap
        if not snap:
            return
        dev_snap = next(iter(snap.values()))
        total = dev_snap.get("Total", 0)
        for phase in phases:
            key = f"{self.micro}/{phase}"
            held = self.phases.get(key)
            if held is None or total > held["total"]:
                self.phases[key] = categories(dev_snap)


def categories(dev_snap: dict) -> dict:
    """A tracker snapshot of one device as {category name: bytes}, with MemTracker's names
    for what FSDPMemTracker calls sharded (without FSDP nothing is sharded) made the same."""
    cats = {str(k).split(".")[-1].lower(): int(v) for k, v in dev_snap.items()}
    for plain, sharded in (("param", "sharded_param"), ("grad", "sharded_grad")):
        if plain in cats:
            cats[sharded] = cats.pop(plain)
    return cats


def depth_key(n_layers: int, n_dense: int | None):
    """The key a measurement of ``n_layers`` blocks is filed under: the block count for a
    dense model (``n_dense`` None), (dense blocks, MoE blocks) for a model with experts whose
    first ``n_dense`` blocks are dense."""
    return n_layers if n_dense is None else (n_dense, n_layers - n_dense)


def measured_depths(layers: list[int], n_layers: int, n_dense: int | None) -> list:
    """The depths to measure (``depth_key``s) for ``plan.layers_measured`` = ``layers`` of a
    model of ``n_layers`` blocks, ``n_dense`` of them dense (None: a dense model).

    A dense model: each count of ``layers`` (at most ``n_layers``). A model with experts grows
    by two kinds of block, so each kind's growth is measured with the other held: MoE blocks
    at each count of ``layers`` after one dense block (none when the model has none), and,
    with two or more dense blocks, dense blocks at each count before one MoE block. The
    deepest MoE measurement is the one extrapolated: its first block is dense as the model's
    is, its last an MoE block. A model of three blocks or more with a single MoE block (a
    pipeline stage of dense blocks and one MoE block) still has the MoE growth measured, at
    one and two MoE blocks: its interior blocks' backward is composed from both kinds'."""
    if n_dense is None:
        return sorted({min(n, n_layers) for n in layers})
    moe_blocks, dense = n_layers - n_dense, min(n_dense, 1)
    most = 2 if moe_blocks == 1 and n_layers >= 3 else moe_blocks
    keys = {(dense, m) for m in _counts(layers, most)}
    if n_dense >= 2:
        keys |= {(d, 1) for d in _counts(layers, n_dense)}
    return sorted(keys)


def _counts(layers: list[int], most: int) -> list[int]:
    """The counts of ``layers`` at most ``most``; two of them where ``most`` allows two (a
    cap that merges them takes the two below it)."""
    counts = sorted({min(n, most) for n in layers})
    return counts if len(counts) > 1 or most < 2 else [most - 1, most]


def extrapolate(measured: dict, n_layers) -> dict[str, dict]:
    """Per phase (``<micro>/<phase>``), the categories at depth ``n_layers``.

    ``measured``: depth -> a child's result (``phases`` and ``marks``); depths are block counts
    (a dense model, ``n_layers`` an int) or (dense, MoE) block counts (``measured_depths``,
    ``n_layers`` such a pair). A model measured at its own depth is returned whole (interior
    blocks included). Otherwise each phase of the base measurement (the deepest; for two kinds,
    the deepest in MoE blocks) grows per added block of each kind by that kind's growth: the
    difference of the phase kind's mark between the two deepest measurements that differ in
    that kind alone; and the interior blocks' backward is composed from the two ends
    (``_interior``)."""
    if n_layers in measured:
        return {k: dict(v) for k, v in measured[n_layers]["phases"].items()}
    single = isinstance(n_layers, int)
    depths = {((d,) if single else tuple(d)): r for d, r in measured.items()}
    target = (n_layers,) if single else tuple(n_layers)
    base = max(depths, key=lambda d: (d[-1], [-c for c in d[:-1]]))
    growth = {
        axis: _growth(depths, axis) for axis in range(len(target)) if target[axis] != base[axis]
    }
    out = {}
    for key, cats in depths[base]["phases"].items():
        micro, phase = key.split("/")
        if phase not in PHASES:
            continue
        for axis, per_mark in growth.items():
            cats = _add(cats, per_mark[f"{micro}/{PHASES[phase]}"], target[axis] - base[axis])
        out[key] = cats
    if sum(target) >= 3:
        last = len(target) - 1  # the last block is of the last kind
        second = 0 if target[0] >= 2 else last  # the block after the first
        for micro in {key.split("/")[0] for key in out}:
            if f"{micro}/bw:last" in out and f"{micro}/bw:first" in out:
                out[f"{micro}/bw:mid"] = _interior(
                    out[f"{micro}/bw:last"],
                    out[f"{micro}/bw:first"],
                    _growth(depths, last)[f"{micro}/end_fw"],
                    _growth(depths, second)[f"{micro}/end_bw"],
                )
    return out


def _growth(depths: dict[tuple, dict], axis: int) -> dict[str, dict]:
    """Per mark, the categories one more block of kind ``axis`` adds: from the two deepest
    measurements that differ in that count alone."""
    pairs = [
        (a, b)
        for a in depths
        for b in depths
        if b[axis] > a[axis] and all(a[i] == b[i] for i in range(len(a)) if i != axis)
    ]
    if not pairs:
        raise ValueError(f"no two measured depths of {sorted(depths)} differ in kind {axis} alone")
    lo, hi = max(pairs, key=lambda p: (p[1][axis], p[0][axis]))
    low, high, blocks = depths[lo]["marks"], depths[hi]["marks"], hi[axis] - lo[axis]
    return {
        key: {k: (b.get(k, 0) - low[key].get(k, 0)) / blocks for k in set(low[key]) | set(b)}
        for key, b in high.items()
    }


def _add(cats: dict, per_block: dict, blocks: float) -> dict:
    """``cats`` plus ``blocks`` times ``per_block``, per category, never below zero."""
    return {
        k: max(0.0, cats.get(k, 0) + blocks * per_block.get(k, 0))
        for k in set(cats) | set(per_block)
    }


def _interior(last: dict, first: dict, below: dict, above: dict) -> dict:
    """The backward of an interior block, composed from the two ends of the same depth.

    FSDP2 overlaps each block's backward with its neighbours' communication: the parameters of
    the block below are gathered ahead (the last block shows that buffer, ``all_gather``) while
    the reduce-scatter of the block above is still in flight (the first block shows that one,
    ``reduce_scatter``); an interior block holds both. The block next to the last has one block
    fewer below and one more above than the last (``below``/``above``: the per-block growth of
    the end of forward and of backward), the block next to the first the converse; the larger
    of the two is returned.
    """
    near_last = _add(_add(last, below, -1), above, 1)
    near_first = _add(_add(first, above, -1), below, 1)
    for cats, other, buffer in (
        (near_last, first, "reduce_scatter"),
        (near_first, last, "all_gather"),
    ):
        extra = max(0.0, other.get(buffer, 0) - cats.get(buffer, 0))
        cats[buffer] = cats.get(buffer, 0) + extra
        cats["total"] = cats.get("total", 0) + extra
    return max(near_last, near_first, key=lambda c: c.get("total", 0))


def phase_name(key: str, n_layers: int, accum: int) -> str:
    """A reader's name for a phase key, e.g. ``backward of block 80 of 80`` (blocks counted from
    the embedding), prefixed with the micro-batch when there are several."""
    micro, phase = key.split("/")
    names = {
        "fw:embed": "forward of the embedding",
        "fw:first": f"forward of block 1 of {n_layers}",
        "fw:mid": "forward of an interior block",
        "fw:last": f"forward of block {n_layers} of {n_layers}",
        "fw:head": "forward of the final norm and output",
        "loss": "loss",
        "loss_bw": "loss backward",
        "bw:head": "backward of the output and final norm",
        "bw:last": f"backward of block {n_layers} of {n_layers}",
        "bw:mid": "backward of an interior block (next to an end)",
        "bw:first": f"backward of block 1 of {n_layers}",
        "bw:embed": "backward of the embedding",
        "bw:end": "gradient reduction after backward",
        "at:blocks_end": "end of the blocks' forward",
        "at:loss_end": "end of the loss",
    }
    name = names[phase]
    if accum > 1:
        which = "micro-batch 1" if micro == "0" else f"micro-batches 2-{accum}"
        if accum == 2 and micro != "0":
            which = "micro-batch 2"
        name = f"{name} ({which} of {accum})"
    return name
