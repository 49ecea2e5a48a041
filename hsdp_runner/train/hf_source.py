"""Documents of ``data=hf``: a local file or folder, or a hub dataset, read through ``datasets``.

``data.path`` names a file (jsonl / json / parquet / arrow / csv / plain text, one document a
line), a folder of such files (its splits inferred by ``datasets`` from the file names, e.g.
``train-*.parquet`` and ``validation.jsonl``), a folder written by ``Dataset.save_to_disk``, or,
when it is none of those, a dataset on the Hugging Face hub. Local data are memory-mapped Arrow
(``datasets`` converts them once into its cache, then reads rows at random, so a resumed job
jumps to its position); with ``data.streaming=true``, and always for a hub dataset, they are
read lazily in order, file by file, so a damaged file is met (and named) when the job gets
there.

The held-out documents are ``data.val_split`` when given, else a fixed fraction
(``data.val_fraction``) of ``data.split`` chosen by a hash of each document's index: the same
documents in every job, whatever its seed, layout or reading mode. ``datasets`` has
``Dataset.train_test_split`` for this, but only for memory-mapped data and it shuffles the
training order too; one hash rule serves both reading modes.

``datasets`` is imported here only, lazily: a job of another ``data.kind`` never pays for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from hsdp_runner.config.schema import DataConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.train.lanes import M64, DataError, mix64

SUFFIX_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
# Fixed, not trainer.seed: runs with other seeds hold out the same documents.
VAL_SALT = 0x5EED_DA7A
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # a folder Dataset.save_to_disk wrote
STREAM_BATCH = 256  # examples a streamed file is read in at a time


def datasets_lib():
    """The ``datasets`` module (imported on first use: ~1.4 s), progress bars and its log off:
    each failure reaches the user as one message of ours naming the file (datasets would
    also log it, as an error of its own, before raising)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


@dataclass(frozen=True)
class SourceSpec:
    """What ``data=hf`` reads: the ``data`` section's reading keys, as a picklable record
    (a loader's worker process rebuilds its reader from it)."""

    path: str
    text_field: str
    split: str
    val_split: Optional[str]
    val_fraction: float
    streaming: bool
    cache_dir: Optional[str]

    @classmethod
    def from_config(cls, data_cfg: DataConfig) -> SourceSpec:
        """The spec of the ``data`` config section ``data_cfg``."""
        return cls(
            path=str(data_cfg.path),
            text_field=data_cfg.text_field,
            split=data_cfg.split,
            val_split=data_cfg.val_split,
            val_fraction=data_cfg.val_fraction,
            streaming=data_cfg.streaming,
            cache_dir=data_cfg.cache_dir,
        )


def held_out(indices: np.ndarray, fraction: float) -> np.ndarray:
    """Bool mask: which document indices (of the split, int64) are held out. Vectorised
    ``mix64`` (numpy's uint64 arithmetic wraps as the scalar one masks)."""
    x = indices.astype(np.uint64) ^ np.uint64(VAL_SALT)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return x < np.uint64(min(int(fraction * 2**64), M64))


def is_held_out(index: int, fraction: float) -> bool:
    """``held_out`` for one index."""
    return mix64(index ^ VAL_SALT) < min(int(fraction * 2**64), M64)


@dataclass(frozen=True)
class Located:
    """Where ``data.path`` points: ``kind`` file / folder / saved / hub; for local files the
    ``datasets`` builder and ``files`` per split."""

    kind: str
    builder: Optional[str] = None
    files: Optional[dict] = None


def locate(spec: SourceSpec) -> Located:
    """Classify ``data.path``; raise ConfigError for a missing path or unreadable file types."""
    path = Path(spec.path).expanduser()
    if path.is_file():
        located = Located("file", _builder_of([path], spec), {"train": [str(path)]})
    elif path.is_dir() and any((path / marker).is_file() for marker in SAVED_MARKERS):
        return Located("saved")
    elif path.is_dir():
        located = _folder(path, spec)
    else:
        return _hub_or_missing(spec, path)
    for name in itertools.chain(*located.files.values()):
        if Path(name).stat().st_size == 0:  # datasets fails on it with a bare StopIteration
            raise ConfigError(
                f"data.path={spec.path!r}: {name} is empty (no documents); remove it or "
                "point data.path at a file with data"
            )
    return located


def _hub_or_missing(spec: SourceSpec, path: Path) -> Located:
    looks_local = spec.path.startswith(("/", ".", "~")) or path.suffix in SUFFIX_BUILDERS
    if looks_local or spec.path.count("/") > 1:
        raise ConfigError(
            f"data.path={spec.path!r} does not exist; point it at a data file or folder "
            "(jsonl, json, parquet, arrow, csv, txt) or a Hugging Face hub dataset name"
        )
    return Located("hub")


def _builder_of(files: list[Path], spec: SourceSpec) -> str:
    builders = {SUFFIX_BUILDERS.get(f.suffix) for f in files}
    if None in builders or len(builders) != 1:
        kinds = ", ".join(sorted({f.suffix or "(none)" for f in files}))
        raise ConfigError(
            f"data.path={spec.path!r} holds files of type {kinds}; data=hf reads one of "
            f"{', '.join(SUFFIX_BUILDERS)} at a time: convert them or point data.path elsewhere"
        )
    return builders.pop()


def _folder(path: Path, spec: SourceSpec) -> Located:
    datasets = datasets_lib()
    try:
        builder = datasets.load_dataset_builder(str(path), cache_dir=spec.cache_dir)
        found = builder.config.data_files or {}
    except Exception as err:  # datasets raises several types for a folder without data
        raise ConfigError(
            f"data.path={spec.path!r} holds no data files datasets can read "
            f"({type(err).__name__}: {_first_line(err)}); put jsonl, json, parquet, arrow, csv "
            "or txt files there"
        ) from None
    files = {str(split): [str(f) for f in found[split]] for split in found}
    builder = _builder_of([Path(f) for f in itertools.chain(*files.values())], spec)
    return Located("folder", builder, files)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


def split_names(spec: SourceSpec, located: Located) -> list[str] | None:
    """The splits ``data.path`` holds (None for a hub dataset: not known without network)."""
    if located.kind == "saved":
        return list(_load_saved(spec))
    return None if located.kind == "hub" else list(located.files)


def _load_saved(spec: SourceSpec) -> dict:
    datasets = datasets_lib()
    loaded = datasets.load_from_disk(str(Path(spec.path).expanduser()))
    return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}


def _load_mapped(spec: SourceSpec, located: Located) -> dict:
    """{split: Dataset} memory-mapped from the datasets cache (built on first use)."""
    if located.kind == "saved":
        return _load_saved(spec)
    datasets = datasets_lib()
    try:
        return dict(
            datasets.load_dataset(
                located.builder, data_files=located.files, cache_dir=spec.cache_dir
            )
        )
    except Exception as err:
        bad = _damaged_file(located, spec.cache_dir)
        where = f"{bad[0]} cannot be read ({bad[1]})" if bad else f"cannot be read ({err!r})"
        raise ConfigError(
            f"data.path={spec.path!r}: {where}; fix or remove that file, or point data.path "
            "elsewhere"
        ) from None


def _damaged_file(located: Located, cache_dir: str | None) -> tuple[str, str] | None:
    """The first file of ``located`` that fails when read alone, and why (the error path)."""
    datasets = datasets_lib()
    for name in itertools.chain(*located.files.values()):
        try:
            for _ in datasets.load_dataset(
                located.builder,
                data_files=[name],
                split="train",
                streaming=True,
                cache_dir=cache_dir,
            ):
                pass
        except Exception as err:
            return name, f"{type(err).__name__}: {_first_line(err)}"
    return None


def _require_split(spec: SourceSpec, available: list[str] | None, split: str, key: str) -> None:
    if available is not None and split not in available:
        raise ConfigError(
            f"{key}={split!r} is not a split of data.path={spec.path!r}: it has "
            f"{', '.join(available)}; set {key} to one of them"
            + ("" if key == "data.split" else ", or null to hold out data.val_fraction")
        )


class MappedDocs:
    """Documents of one role (training or held-out) of memory-mapped data, read by number:
    document ``g`` is row ``rows[g % len(rows)]`` (later passes start over)."""

    def __init__(self, dataset, rows: np.ndarray, spec: SourceSpec):
        self.dataset, self.rows, self.field = dataset, rows, spec.text_field
        self.count = len(rows)

    def texts(self, numbers: list[int]) -> list[str]:
        """The texts of documents ``numbers`` (any order, any pass)."""
        if not numbers:
            return []
        rows = self.rows[np.asarray(numbers, dtype=np.int64) % self.count]
        return self.dataset[rows.tolist()][self.field]

    def iter_texts(self, chunk: int = 256) -> Iterator[str]:
        """Every document of one pass, in order."""
        for start in range(0, self.count, chunk):
            yield from self.texts(list(range(start, min(start + chunk, self.count))))


class StreamedDocs:
    """Documents of one role read lazily in order, file by file (a hub dataset: its split
    as one stream); document numbers keep counting over later passes. ``texts`` takes
    increasing numbers only."""

    def __init__(self, spec: SourceSpec, located: Located, split: str, keep_held_out):
        self.spec, self.located, self.split = spec, located, split
        self.keep_held_out = keep_held_out  # None: every document; True/False: carve
        self._stream = self._numbered()
        self._at: tuple[int, str] | None = None  # the last document read
        self._reading = spec.path  # the file being read

    def _pass(self) -> Iterator[dict]:
        """The batches of examples (as columns) of one pass over the split; ``_reading``
        names the file (or hub dataset) being read.

        Through ``IterableDataset.iter``: its ``__iter__`` would split the files among the
        worker processes of a DataLoader, each of which reads its own lanes of every file."""
        datasets = datasets_lib()
        if self.located.kind == "hub":
            self._reading = self.spec.path
            examples = datasets.load_dataset(
                self.spec.path, split=self.split, streaming=True, cache_dir=self.spec.cache_dir
            )
            yield from examples.iter(STREAM_BATCH)
            return
        for name in self.located.files[self.split]:
            self._reading = name
            examples = datasets.load_dataset(
                self.located.builder,
                data_files=[name],
                split="train",
                streaming=True,
                cache_dir=self.spec.cache_dir,
            )
            yield from examples.iter(STREAM_BATCH)

    def _checked_pass(self) -> Iterator[tuple[str, dict]]:
        it = self._pass()
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except Exception as err:
                fix = (
                    "check the dataset's name, data.split and the network, or point data.path "
                    "at a local copy"
                    if self.located.kind == "hub"
                    else "fix or remove it (a rerun resumes from the job's last checkpoint)"
                )
                raise DataError(
                    f"data.path={self.spec.path!r}: {self._reading} cannot be read "
                    f"({type(err).__name__}: {_first_line(err)}); {fix}"
                ) from None
            yield self._reading, batch

    def _one_pass(self) -> Iterator[str]:
        """The texts of this role in one pass over the split, in order."""
        index = 0
        for source, batch in self._checked_pass():
            for text in _texts(batch, self.spec, source):
                keep = self.keep_held_out is None or (
                    is_held_out(index, self.spec.val_fraction) == self.keep_held_out
                )
                index += 1
                if keep:
                    yield text

    def _numbered(self) -> Iterator[tuple[int, str]]:
        """(number, text) over pass after pass; ends only if a pass holds nothing."""
        number = 0
        while True:
            start = number
            for text in self._one_pass():
                yield number, text
                number += 1
            if number == start:
                return

    def texts(self, numbers: list[int]) -> list[str]:
        """The texts of documents ``numbers`` (increasing, none before the last one read)."""
        out = []
        for number in numbers:
            if self._at is None or number > self._at[0]:
                self._at = next((d for d in self._stream if d[0] == number), None)
                if self._at is None:
                    raise DataError(f"data.path={self.spec.path!r} holds no documents")
            elif number < self._at[0]:
                raise RuntimeError(f"streamed documents read backwards ({number})")
            out.append(self._at[1])
        return out

    def iter_texts(self) -> Iterator[str]:
        """Every document of one pass, in order (a stream of its own)."""
        return StreamedDocs(self.spec, self.located, self.split, self.keep_held_out)._one_pass()


def _texts(batch: dict, spec: SourceSpec, source: str) -> list[str]:
    """The texts of a batch of examples (None counts as empty); DataError without the field."""
    if spec.text_field not in batch:
        raise DataError(
            f"data.text_field={spec.text_field!r} is not a field of {source} (it has "
            f"{', '.join(batch)}); set data.text_field"
        )
    return ["" if value is None else str(value) for value in batch[spec.text_field]]


def open_docs(spec: SourceSpec, role: str):
    """The documents of ``role`` ("train" or "val"): MappedDocs for local data read
    memory-mapped, else StreamedDocs. Raises ConfigError for a missing path, split or field."""
    located = locate(spec)
    carve = spec.val_split is None
    split = spec.split if role == "train" or carve else spec.val_split
    available = split_names(spec, located)
    _require_split(spec, available, spec.split, "data.split")
    if not carve:
        _require_split(spec, available, spec.val_split, "data.val_split")
    if located.kind == "hub" or (spec.streaming and located.kind != "saved"):
        return StreamedDocs(spec, located, split, (role == "val") if carve else None)
    dataset = _load_mapped(spec, located)[split]
    if spec.text_field not in dataset.column_names:
        raise ConfigError(
            f"data.text_field={spec.text_field!r} is not a column of data.path={spec.path!r} "
            f"(split {split}: {', '.join(dataset.column_names)}); set data.text_field"
        )
    rows = np.arange(len(dataset), dtype=np.int64)
    if carve:
        mask = held_out(rows, spec.val_fraction)
        rows = rows[mask] if role == "val" else rows[~mask]
    return MappedDocs(dataset, rows, spec)
