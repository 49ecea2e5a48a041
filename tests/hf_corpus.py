"""A small corpus and a tokenizer made at test time for the data=hf tests; nothing is fetched.

Every document starts with its own id word (``doc17``), which the word-level tokenizer gives a
token of its own, so a test can say which documents a window holds.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

WORDS = (
    "the a fox dog runs jumps over under quick lazy brown red data model layer shard rank "
    "step loss token"
).split()
N_DOCS = 400
SPECIALS = ["<unk>", "<s>", "</s>"]
VOCAB = 512  # model.vocab_size of jobs on this corpus (the tokenizer has 3 + 20 + 400 tokens)


def documents(n: int = N_DOCS, seed: int = 0) -> list[str]:
    """``n`` documents of 3-40 words after their id word, seeded."""
    rng = random.Random(seed)
    return [
        " ".join([f"doc{i}"] + [rng.choice(WORDS) for _ in range(rng.randint(3, 40))])
        for i in range(n)
    ]


def train_tokenizer(docs: list[str], path: Path) -> Path:
    """A word-level tokenizer of ``docs`` (trained by ``tokenizers``, in milliseconds)."""
    # Set before training: the job processes forked later would otherwise inherit a used
    # thread pool (tokenizers then turns its threads off in them, with a warning).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    tokenizer.save(str(path))
    return path


def make_corpus(folder: Path) -> SimpleNamespace:
    """Write the corpus as ``docs.jsonl`` and ``docs.parquet`` (fields ``text`` and ``id``)
    and its tokenizer ``tokenizer.json`` into ``folder``; return their paths, the texts and
    a cache dir for datasets."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    docs = documents()
    jsonl = folder / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    parquet = folder / "docs.parquet"
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), parquet)
    return SimpleNamespace(
        docs=docs,
        jsonl=jsonl,
        parquet=parquet,
        tokenizer=train_tokenizer(docs, folder / "tokenizer.json"),
        cache=folder / "cache",
    )


def hf_overrides(corpus: SimpleNamespace, path: Path | None = None) -> list[str]:
    """The overrides of a data=hf job on ``corpus`` (its jsonl unless ``path``)."""
    return [
        "data=hf",
        f"data.path={path or corpus.jsonl}",
        f"data.tokenizer={corpus.tokenizer}",
        f"data.cache_dir={corpus.cache}",
        "data.val_fraction=0.1",
        "data.shuffle_buffer=4",
        f"model.vocab_size={VOCAB}",
    ]
