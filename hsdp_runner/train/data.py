"""Deterministic token batches: the same global batch at a given step in every layout.

A batch is a function of (seed, step) alone; each data-parallel rank takes its contiguous
slice of it, and each context-parallel rank its part of every sequence (inputs and targets
alike, in the head-tail order of ``context_parallel``). That keeps layouts comparable and makes
the loader position just the step.
Two sources here: ``synthetic`` (a seeded Zipf + bigram process, any vocab) and ``text`` (a
real corpus through a byte-level tokenizer; by default the Python documentation topics that
ship with CPython in ``pydoc_data``). ``Prefetcher`` makes the next step's batch in a background
thread while the current step runs, so the step itself only picks it up. The held-out batches
are those of steps no run reaches (``EVAL_STEP_OFFSET`` on).

The third, ``hf`` (a dataset and a tokenizer of Hugging Face's libraries), is a stream with a
saved position (``hf_batches.HFBatches``); ``make_batches`` builds either for a rank. Both
answer ``held_out(i)``, ``split(rows)`` and ``stream(start_step, device)``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from hsdp_runner.config.schema import DataConfig
from hsdp_runner.core.choices import DataKind
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.context_parallel import shard_sequence
from hsdp_runner.train.hf_batches import HFBatches

# Held-out batches come from step indices no training run reaches.
EVAL_STEP_OFFSET = 1 << 40


def encode_bytes(text: str) -> torch.Tensor:
    """Byte-level tokenizer: UTF-8 bytes as token ids 0..255 (int64 tensor)."""
    data = text.encode("utf-8")
    if not data:  # torch.frombuffer rejects an empty buffer
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode_bytes(tokens: torch.Tensor) -> str:
    """Inverse of ``encode_bytes``; invalid UTF-8 sequences are replaced."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def default_corpus() -> str:
    """The Python documentation topics shipped with CPython (about 460 KB of English prose)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def load_corpus(path: str | None, min_tokens: int) -> torch.Tensor:
    """Read and tokenize the text corpus at ``path`` (None: the default corpus).

    Raises ConfigError if the path is missing, not a file, or shorter than ``min_tokens``.
    """
    if path is None:
        text = default_corpus()
    else:
        file = Path(path).expanduser()
        if not file.is_file():
            raise ConfigError(
                f"data.path={path!r} does not exist or is not a file; point it at a "
                "UTF-8 text file, or set data.path=null for the built-in corpus"
            )
        text = file.read_text(encoding="utf-8", errors="replace")
    tokens = encode_bytes(text)
    if tokens.numel() < min_tokens:
        raise ConfigError(
            f"data.path={path!r} holds {tokens.numel()} bytes, fewer than one "
            f"sequence of model.seq_len+1={min_tokens}; use a larger file"
        )
    return tokens


def follow_successors(
    draws: torch.Tensor, follow: torch.Tensor, successor: torch.Tensor
) -> torch.Tensor:
    """Apply the chain rule left to right: where ``follow[:, t]`` (t >= 1), token t becomes
    ``successor[token t-1]`` (of the already chained token), else it keeps ``draws[:, t]``.

    Takes (n, length) int64 draws, a bool mask of the same shape and the successor table;
    returns a new (n, length) tensor. Equal to the loop over t, but vectorised: a token that
    ends a run of k follows is ``successor`` applied k times to the run's first draw, so the
    work is one pass per hop of the longest run (about log2 of the batch's token count for
    a fair coin), each over the tokens still that many hops from their anchor.
    """
    length = draws.shape[1]
    pos = torch.arange(length)
    anchor = torch.where(follow & (pos > 0), 0, pos).cummax(dim=1).values
    hops = (pos - anchor).flatten()
    out = draws.flatten().clone()
    todo = hops.nonzero().squeeze(1)  # flat indices of following tokens, ascending
    hop = 1
    while todo.numel():
        done = todo[hops[todo] == hop]
        out[done] = successor[out[done - 1]]
        todo = todo[hops[todo] > hop]
        hop += 1
    return out.view_as(draws)


class TokenBatches:
    """Yields this rank's (inputs, targets) for a step; see the module docstring."""

    stateful = False  # the position is the step: nothing to save

    def __init__(
        self,
        data_cfg: DataConfig,
        vocab_size: int,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        cp_rank: int = 0,
        cp_size: int = 1,
    ):
        self.kind = DataKind(data_cfg.kind)
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.corpus = (
            load_corpus(data_cfg.path, seq_len + 1) if self.kind is DataKind.text else None
        )
        if self.kind is DataKind.synthetic:
            # Fixed per seed: a Zipf unigram law and a random successor for every token. A token
            # follows its predecessor's successor half the time, else is drawn from the Zipf law,
            # so the loss falls quickly (unigram, then bigram) below log(vocab).
            gen = torch.Generator().manual_seed(seed)
            ranks = torch.randperm(vocab_size, generator=gen).float() + 1
            self.unigram = ranks.pow(-1.1)
            self.successor = torch.randperm(vocab_size, generator=gen)

    def global_batch_at(self, step: int) -> torch.Tensor:
        """Return the whole step's batch, (global_batch, seq_len + 1) int64, on CPU."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n, length = self.global_batch, self.seq_len + 1
        if self.kind is DataKind.synthetic:
            draws = torch.multinomial(
                self.unigram, n * length, replacement=True, generator=gen
            ).view(n, length)
            follow = torch.rand(n, length, generator=gen) < 0.5
            return follow_successors(draws, follow, self.successor)
        offsets = torch.randint(0, self.corpus.numel() - length + 1, (n,), generator=gen)
        return self.corpus[offsets[:, None] + torch.arange(length)]

    def local_rows(self, step: int) -> torch.Tensor:
        """Return this dp rank's rows of the step's batch, (rows, seq_len + 1) int64, on CPU."""
        rows = self.global_batch // self.dp_size
        return self.global_batch_at(step)[self.dp_rank * rows : (self.dp_rank + 1) * rows]

    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this rank's part of the step's batch as (inputs, targets): its dp rows, and
        of each row its cp part."""
        return self.split(self.local_rows(step))

    def manifest_facts(self, step: int) -> dict:
        """How a checkpoint's manifest describes the loader position after ``step``."""
        return {"loader": "stateless: batch(step) = f(seed, step), sliced by dp rank"}

    def held_out(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of held-out batch ``index`` (never trained on) as (inputs,
        targets), on CPU."""
        return self.local_batch(EVAL_STEP_OFFSET + index)

    def stream(self, start_step: int, device: torch.device) -> Prefetcher:
        """This rank's batches from ``start_step`` on, made a step ahead (``Prefetcher``)."""
        return Prefetcher(self, device)

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of ``local_rows``' (rows, seq_len + 1) tokens, each cut to this cp
        rank's positions (a target stays beside its input token)."""
        inputs, targets = rows[:, :-1], rows[:, 1:]
        return (
            shard_sequence(inputs, self.cp_size, self.cp_rank),
            shard_sequence(targets, self.cp_size, self.cp_rank),
        )


class Prefetcher:
    """This rank's batches for consecutive steps, made one step ahead in a background thread.

    ``get(step)`` returns (inputs, targets) on ``device`` and starts making ``step + 1``'s. On
    CUDA the batch is made in pinned memory and copied with ``non_blocking=True`` on the
    current stream, so the host never waits for the copy and the step's kernels are ordered
    after it. The batch is the same as ``TokenBatches.local_batch`` (a function of seed and
    step), whichever thread makes it. ``close()`` stops the thread.
    """

    def __init__(self, batches: TokenBatches, device: torch.device):
        self.batches, self.device = batches, device
        self.pin = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsdp-data")
        self._ahead: tuple[int, Future] | None = None

    def _make(self, step: int) -> torch.Tensor:
        batch = self.batches.local_rows(step)
        return batch.pin_memory() if self.pin else batch

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this rank's (inputs, targets) for ``step`` on the device; prefetch the next."""
        if self._ahead is not None and self._ahead[0] == step:
            batch = self._ahead[1].result()
        else:
            batch = self._make(step)
        self._ahead = (step + 1, self._pool.submit(self._make, step + 1))
        return self.batches.split(batch.to(self.device, non_blocking=True))

    def state_at(self, step: int) -> None:
        """No state: a batch is a function of (seed, step) (``HFBatches``' streams have one)."""
        return None

    def close(self) -> None:
        """Stop the background thread (a batch being made is finished and dropped)."""
        self._ahead = None
        self._pool.shutdown(wait=True, cancel_futures=True)


def make_batches(
    data_cfg: DataConfig,
    vocab_size: int,
    seq_len: int,
    global_batch: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> TokenBatches | HFBatches:
    """This rank's batches of ``data.kind`` (the ``data`` section ``data_cfg``): HFBatches for
    ``hf``, else TokenBatches; the other arguments as TokenBatches takes them."""
    kind = HFBatches if DataKind(data_cfg.kind) is DataKind.hf else TokenBatches
    return kind(
        data_cfg, vocab_size, seq_len, global_batch, dp_rank, dp_size, seed, cp_rank, cp_size
    )
