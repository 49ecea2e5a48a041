"""Data: deterministic global batches, dp slices that tile them, the byte-level text corpus."""

from types import SimpleNamespace as NS

import pytest
import torch

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.train.data import (
    TokenBatches,
    decode_bytes,
    default_corpus,
    encode_bytes,
    load_corpus,
)


def batches(kind="synthetic", dp_rank=0, dp_size=1, path=None, seed=0):
    return TokenBatches(
        NS(kind=kind, path=path),
        vocab_size=256,
        seq_len=16,
        global_batch=8,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
    )


@pytest.mark.parametrize("kind", ["synthetic", "text"])
def test_dp_slices_tile_the_same_global_batch(kind):
    whole = batches(kind).global_batch_at(3)
    slices = [batches(kind, r, 4).local_batch(3) for r in range(4)]
    inputs = torch.cat([x for x, _ in slices])
    targets = torch.cat([y for _, y in slices])
    assert torch.equal(inputs, whole[:, :-1]) and torch.equal(targets, whole[:, 1:])
    assert not torch.equal(whole, batches(kind).global_batch_at(4))
    assert not torch.equal(whole, batches(kind, seed=1).global_batch_at(3))


def test_byte_tokenizer_round_trips_and_corpus_ships_with_python():
    text = "HSDP — shard inside a node ✓"
    assert decode_bytes(encode_bytes(text)) == text
    corpus = default_corpus()
    assert len(corpus) > 100_000 and "def" in corpus
    assert int(load_corpus(None, 10).max()) < 256


def test_missing_or_short_text_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data.path='/nope' does not exist"):
        load_corpus("/nope", 10)
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        load_corpus(str(short), 10)
    with pytest.raises(ConfigError, match="not a file"):
        load_corpus(str(tmp_path), 10)
