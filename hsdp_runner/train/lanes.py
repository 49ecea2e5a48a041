"""Documents packed into training windows, lane by lane, from a position any dp degree can resume.

A step's global batch has ``trainer.global_batch_size`` rows; row ``b`` of every step is the next
window of lane ``b``. Lanes are a property of the batch, not of the ranks: a data-parallel rank
makes the windows of its own contiguous lanes (tp, cp and pp ranks of one replica make the same
ones), so the batch of a step is the same at every dp degree, and a lane's state, saved per lane,
resumes on whichever rank owns the lane next.

A lane's k-th incoming document is training document ``g = k * n_lanes + lane`` (``g`` counts
training documents over repeated passes; ``DocReader`` maps it to a row), so reading "round"
``k`` gives every lane its k-th document. A lane keeps a shuffle buffer of ``buffer_size``
documents: each draw takes a slot chosen by a counter-based hash of (seed, lane, draw) and puts the
next incoming document there, as Hugging Face's ``IterableDataset.shuffle`` does with Python's
RNG. Drawn documents, each ``[BOS] + tokens + [EOS]``, are concatenated and cut into windows of
``seq_len + 1`` tokens, one window per step (torchtitan's packing).

The state of a lane (``LaneState``) is a few integers and document numbers, never tokens: its
next incoming document, how many draws it made, the documents in its buffer and the unread
tails of the documents it has drawn. Restoring reads and tokenizes those documents again.

Written here rather than taken from ``datasets``: ``IterableDataset.shuffle`` +
``split_dataset_by_node`` + ``state_dict`` resume only at the same number of ranks (the state is
per rank's shard) and drop the shuffle buffer on resume (its documents are skipped), and
torchdata's ``StatefulDataLoader`` keeps a per-rank, per-worker state too. A state per lane of
the global batch is what lets a job resume at another data-parallel degree, exactly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

M64 = (1 << 64) - 1
# A lane that draws this many empty documents in a row has nothing to train on.
MAX_EMPTY_DRAWS = 100_000


class DataError(RuntimeError):
    """A data file or document that fails while a job trains (its message names the file)."""


def mix64(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer -> a well-mixed 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def lane_draw(seed: int, lane: int, draw: int) -> int:
    """The ``draw``-th random 64-bit number of ``lane`` under ``seed``.

    Counter-based (a hash of its three inputs) rather than Python's ``random.Random``, whose
    state is 625 words: a lane's RNG position is then the one integer ``draws`` it saves."""
    return mix64(mix64(mix64(seed & M64) ^ lane) ^ draw)


@dataclass
class LaneState:
    """Where a lane stands after some windows; JSON-able, tokens excluded.

    ``next_doc``: the index k of its next incoming document; ``draws``: draws made from its
    buffer; ``buffer``: the training document numbers g in its buffer slots; ``pending``:
    ``[g, start]`` of each drawn document whose tokens from ``start`` on are not in a window
    yet, oldest first."""

    next_doc: int = 0
    draws: int = 0
    buffer: list = field(default_factory=list)
    pending: list = field(default_factory=list)

    def to_dict(self) -> dict:
        """The state as plain JSON data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LaneState:
        """Read ``to_dict``'s form back."""
        return cls(**data)

    def documents(self) -> set[int]:
        """The document numbers a restore must read again (buffer and pending)."""
        return set(self.buffer) | {g for g, _ in self.pending}


class DocReader(Protocol):
    """Reads training documents by round: round k holds documents ``k * n_lanes + lane``."""

    def read(self, round_: int, lanes: list[int]) -> list[str]:
        """The texts of round ``round_``'s documents of ``lanes`` (in that order). A streamed
        source reads rounds in increasing order only."""


Encoder = Callable[[list[str]], list[np.ndarray]]


class Lane:
    """One lane's shuffle buffer and packing; ``LaneGroup`` feeds it documents."""

    def __init__(self, lane: int, buffer_size: int, seed: int, window: int, state: LaneState):
        self.lane, self.buffer_size, self.seed, self.window = lane, buffer_size, seed, window
        self.next_doc, self.draws = state.next_doc, state.draws
        self.incoming: deque = deque()  # (g, tokens) read ahead, in order
        self.buffer: list = [None] * len(state.buffer)  # (g, tokens) per slot, once restored
        self.pending: deque = deque()  # [g, tokens, start]
        self.pending_tokens = 0
        self._restore = state if state.documents() else None  # until restored
        self._empty_draws = 0

    def restore(self, tokens: dict[int, np.ndarray]) -> None:
        """Put the saved buffer and pending documents back from their ``tokens`` by g."""
        state = self._restore
        self.buffer = [(g, tokens[g]) for g in state.buffer]
        for g, start in state.pending:
            self.pending.append([g, tokens[g], start])
            self.pending_tokens += len(tokens[g]) - start
        self._restore = None

    def take_window(self) -> np.ndarray | None:
        """The next window (int32, ``window`` tokens), or None when an incoming document is
        needed first."""
        while self.pending_tokens < self.window:
            if not self.incoming:
                return None
            doc = self.incoming.popleft()
            self.next_doc += 1
            if self.buffer_size == 0:  # data.shuffle_buffer=0: documents in order
                self._add_pending(doc)
                continue
            if len(self.buffer) < self.buffer_size:  # still filling the buffer
                self.buffer.append(doc)
                continue
            slot = lane_draw(self.seed, self.lane, self.draws) % self.buffer_size
            self.draws += 1
            drawn, self.buffer[slot] = self.buffer[slot], doc
            self._add_pending(drawn)
        return self._cut()

    def _add_pending(self, doc: tuple[int, np.ndarray]) -> None:
        g, tokens = doc
        if len(tokens) == 0:
            self._empty_draws += 1
            if self._empty_draws >= MAX_EMPTY_DRAWS:
                raise DataError(
                    f"lane {self.lane} drew {MAX_EMPTY_DRAWS} empty documents in a row: "
                    "data.text_field holds no text"
                )
            return
        self._empty_draws = 0
        self.pending.append([g, tokens, 0])
        self.pending_tokens += len(tokens)

    def _cut(self) -> np.ndarray:
        parts, need = [], self.window
        while need:
            entry = self.pending[0]
            _, tokens, start = entry
            take = min(need, len(tokens) - start)
            parts.append(tokens[start : start + take])
            need -= take
            if start + take == len(tokens):
                self.pending.popleft()
            else:
                entry[2] = start + take
        self.pending_tokens -= self.window
        return np.concatenate(parts)

    def state(self) -> LaneState:
        """The lane's state now (after its last window)."""
        if self._restore is not None:
            return self._restore
        return LaneState(
            next_doc=self.next_doc,
            draws=self.draws,
            buffer=[g for g, _ in self.buffer],
            pending=[[g, start] for g, _, start in self.pending],
        )


class LaneGroup:
    """The lanes ``lanes`` (of ``n_lanes``) one process makes windows for, reading through one
    ``DocReader`` and tokenizing with ``encode`` (texts -> ``[BOS] + ids + [EOS]`` arrays).

    ``states`` ({lane: LaneState}) resumes each lane where it stood; None starts afresh.
    ``read_rounds``: rounds read and tokenized together when a lane runs dry (one batch for
    the tokenizer)."""

    def __init__(
        self,
        reader: DocReader,
        encode: Encoder,
        lanes: range,
        n_lanes: int,
        buffer_size: int,
        seed: int,
        window: int,
        states: dict[int, LaneState] | None = None,
        read_rounds: int = 4,
    ):
        self.reader, self.encode, self.n_lanes = reader, encode, n_lanes
        self.read_rounds = read_rounds
        states = states or {}
        self.lanes = [
            Lane(lane, buffer_size, seed, window, states.get(lane) or LaneState()) for lane in lanes
        ]
        # Per lane, the first round not yet queued for it.
        self.queued_until = {lane.lane: lane.next_doc for lane in self.lanes}
        self.next_round = min(self.queued_until.values(), default=0)
        self._restore()

    def _restore(self) -> None:
        """Read the saved lanes' buffer and pending documents again, round by round, queuing
        the incoming ones met on the way (a streamed source reads forward only)."""
        wanted: dict[int, set[int]] = {}  # round -> lanes whose document there is needed
        for lane in self.lanes:
            for g in lane.state().documents():
                wanted.setdefault(g // self.n_lanes, set()).add(lane.lane)
        if not wanted:
            return
        tokens: dict[int, dict[int, np.ndarray]] = {lane.lane: {} for lane in self.lanes}
        for round_ in range(min(min(wanted), self.next_round), max(wanted) + 1):
            needed = sorted(wanted.get(round_, ()))
            queue = [lane for lane in self.lanes if self.queued_until[lane.lane] <= round_]
            chosen = sorted(set(needed) | {lane.lane for lane in queue})
            if not chosen:
                continue
            docs = dict(zip(chosen, self.encode(self.reader.read(round_, chosen))))
            for lane_id in needed:
                tokens[lane_id][round_ * self.n_lanes + lane_id] = docs[lane_id]
            self._queue(round_, queue, docs)
        self.next_round = max(self.next_round, max(wanted) + 1)
        for lane in self.lanes:
            lane.restore(tokens[lane.lane])

    def _queue(self, round_: int, lanes: list[Lane], docs: dict[int, np.ndarray]) -> None:
        for lane in lanes:
            lane.incoming.append((round_ * self.n_lanes + lane.lane, docs[lane.lane]))
            self.queued_until[lane.lane] = round_ + 1

    def _read_ahead(self) -> None:
        """Read and tokenize the next ``read_rounds`` rounds for every lane that has queued
        no further (one tokenizer call for all of them)."""
        rounds = range(self.next_round, self.next_round + self.read_rounds)
        plan = [
            (round_, [lane for lane in self.lanes if self.queued_until[lane.lane] <= round_])
            for round_ in rounds
        ]
        texts = [self.reader.read(r, [lane.lane for lane in ls]) if ls else [] for r, ls in plan]
        encoded = iter(self.encode([t for batch in texts for t in batch]))
        for (round_, lanes), _ in zip(plan, texts):
            self._queue(round_, lanes, {lane.lane: next(encoded) for lane in lanes})
        self.next_round = rounds.stop

    def next_rows(self) -> tuple[np.ndarray, dict[int, dict]]:
        """One window per lane: ((lanes, window) int32 rows in lane order, {lane: state
        after it, as ``LaneState.to_dict``})."""
        rows = []
        for lane in self.lanes:
            while (window := lane.take_window()) is None:
                self._read_ahead()
            rows.append(window)
        return np.stack(rows), {lane.lane: lane.state().to_dict() for lane in self.lanes}
