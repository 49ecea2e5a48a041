"""data=hf's loader without a model: packing, shuffling, the held-out carve, streamed vs
memory-mapped reading, and a position that resumes at another data-parallel degree with every
sample seen once (sample ids recorded). On a corpus and tokenizer made at test time."""

from __future__ import annotations

import ast
import json

import numpy as np
import pytest
import torch
from conftest import REPO
from hf_corpus import VOCAB, make_corpus

from hsdp_runner.config.schema import DataConfig
from hsdp_runner.core.choices import DataKind
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.train.hf_batches import HFBatches, position
from hsdp_runner.train.hf_source import held_out, is_held_out
from hsdp_runner.train.lanes import LaneGroup, LaneState

SEQ, GBS = 32, 8
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def data_config(corpus, **changes) -> DataConfig:
    values = dict(
        kind=DataKind.hf,
        path=str(corpus.jsonl),
        tokenizer=str(corpus.tokenizer),
        cache_dir=str(corpus.cache),
        val_fraction=0.1,
        shuffle_buffer=4,
    )
    return DataConfig(**{**values, **changes})


def run_leg(corpus, dp: int, start: int, steps: int, saved: dict | None = None, **changes):
    """Steps ``start`` .. ``start + steps - 1`` at data-parallel degree ``dp``, each rank its
    own HFBatches (resumed from ``saved``); return (each step's global rows, the position after
    them as a checkpoint stores it)."""
    per_rank, states = [], {}
    for rank in range(dp):
        batches = HFBatches(data_config(corpus, **changes), VOCAB, SEQ, GBS, rank, dp, seed=0)
        if saved is not None:
            batches.restore(saved)
        stream = batches.stream(start, CPU)
        got = []
        for step in range(start, start + steps):
            inputs, targets = stream.get(step)
            got.append(torch.cat([inputs, targets[:, -1:]], dim=1))
        states.update(stream.state_at(start + steps))
        stream.close()
        per_rank.append(got)
    rows = [torch.cat([part[i] for part in per_rank]) for i in range(steps)]
    return rows, json.loads(json.dumps(position(states, start + steps, GBS)))


def sample_ids(corpus, rows: list[torch.Tensor]) -> list[int]:
    """The documents (by id word) whose text starts in the windows, in step and row order."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(corpus.tokenizer)).get_vocab()
    doc_of = {i: int(w[3:]) for w, i in vocab.items() if w.startswith("doc")}
    return [doc_of[t] for step in rows for row in step for t in row.tolist() if t in doc_of]


@pytest.mark.multiprocess  # the dp 2 leg's DataLoader worker processes
def test_resume_at_dp_4_then_2_then_8_sees_each_sample_once(corpus):
    """Three steps at dp 4, three at dp 2 (two DataLoader workers per rank), three at dp 8
    (streamed), each from the position the last saved: the very batches of one uninterrupted
    run, every document once, none held out."""
    straight, _ = run_leg(corpus, 1, 0, 9)
    first, saved = run_leg(corpus, 4, 0, 3)
    assert saved["samples"] == 3 * GBS and saved["lanes"] == GBS
    second, saved = run_leg(corpus, 2, 3, 3, saved, workers=2)
    third, _ = run_leg(corpus, 8, 6, 3, saved, streaming=True)
    resumed = first + second + third
    for step, (a, b) in enumerate(zip(straight, resumed)):
        assert torch.equal(a, b), f"step {step + 1} differs after resuming"
    ids = sample_ids(corpus, resumed)
    assert ids == sample_ids(corpus, straight)
    assert len(ids) == len(set(ids)) > 60  # each document once (the first pass is not over)
    assert not any(is_held_out(i, 0.1) for i in ids)
    assert sorted(ids) != ids  # shuffled, not in file order


def test_streamed_parquet_and_memory_mapped_jsonl_give_the_same_batches(corpus):
    mapped, _ = run_leg(corpus, 2, 0, 2)
    streamed, _ = run_leg(corpus, 2, 0, 2, path=str(corpus.parquet), streaming=True)
    assert all(torch.equal(a, b) for a, b in zip(mapped, streamed))
    other_seed = HFBatches(data_config(corpus), VOCAB, SEQ, GBS, 0, 1, seed=1).stream(0, CPU)
    assert not torch.equal(other_seed.get(0)[0], mapped[0][:, :-1])
    other_seed.close()


def test_held_out_batches_are_the_held_out_documents_packed_in_order(corpus):
    """Held-out batch i is windows [i * gbs, (i + 1) * gbs) of the held-out documents, split
    over the dp ranks like a training batch; streamed and mapped reading agree."""
    whole = HFBatches(data_config(corpus), VOCAB, SEQ, GBS, 0, 1, seed=0)
    inputs, targets = whole.held_out(1)
    assert inputs.shape == (GBS, SEQ) and torch.equal(inputs[:, 1:], targets[:, :-1])
    halves = [HFBatches(data_config(corpus), VOCAB, SEQ, GBS, r, 2, seed=3) for r in (0, 1)]
    assert torch.equal(torch.cat([h.held_out(1)[0] for h in halves]), inputs)
    streamed = HFBatches(data_config(corpus, streaming=True), VOCAB, SEQ, GBS, 0, 1, seed=0)
    assert torch.equal(streamed.held_out(1)[0], inputs)
    ids = sample_ids(corpus, [torch.cat([inputs, targets[:, -1:]], dim=1)])
    assert ids and all(is_held_out(i, 0.1) for i in ids) and ids == sorted(ids)


def test_held_out_carve_is_one_fixed_rule():
    index = np.arange(5000)
    mask = held_out(index, 0.1)
    assert [is_held_out(int(i), 0.1) for i in index[:300]] == mask[:300].tolist()
    assert 0.08 < mask.mean() < 0.12
    assert not held_out(index, 1e-9).any() and held_out(index, 1 - 1e-9).all()


def fake_encode(texts: list[str]) -> list[np.ndarray]:
    """Document g -> tokens 1000 * g .. 1000 * g + (g % 7) + 2: every token names its
    document."""
    return [np.arange(1000 * int(t), 1000 * int(t) + int(t) % 7 + 2, dtype=np.int32) for t in texts]


class FakeReader:
    def __init__(self, n_lanes: int):
        self.n_lanes = n_lanes

    def read(self, round_: int, lanes: list[int]) -> list[str]:
        return [str(round_ * self.n_lanes + lane) for lane in lanes]


def test_a_lane_packs_each_drawn_document_whole_once_in_a_seeded_order():
    def lane(seed):
        """Lane 1 of 3 over 40 windows: the documents in the order they came, its state."""
        group = LaneGroup(FakeReader(3), fake_encode, range(3), 3, 5, seed, window=6)
        tokens = np.concatenate([group.next_rows()[0][1] for _ in range(40)])
        return tokens, list(dict.fromkeys(int(t) // 1000 for t in tokens)), group.lanes[1].state()

    tokens, order, state = lane(seed=0)
    assert all(doc % 3 == 1 for doc in order)  # lane 1's documents only
    assert order != sorted(order) and order != lane(seed=1)[1]
    unfinished = {g for g, _ in state.pending} & set(order)
    assert len(unfinished) <= 1 and set(order) - unfinished
    for doc in set(order) - unfinished:  # whole, in order, once
        assert [t for t in tokens if t // 1000 == doc] == fake_encode([str(doc)])[0].tolist()
    assert not set(state.buffer) & set(order) - unfinished  # the buffer holds undrawn ones


def test_a_position_of_another_batch_size_is_refused(corpus):
    batches = HFBatches(data_config(corpus), VOCAB, SEQ, GBS, 0, 1, seed=0)
    saved = position({lane: LaneState().to_dict() for lane in range(4)}, 2, 4)
    with pytest.raises(ConfigError, match="keep trainer.global_batch_size=4"):
        batches.restore(saved)


def test_datasets_and_tokenizers_are_imported_only_inside_functions():
    """Only a data=hf job pays for them (datasets alone takes ~1.4 s to import): no module of
    the package imports them, or pyarrow, at its top level."""
    lazy = {"datasets", "tokenizers", "pyarrow"}
    found = []
    for path in sorted((REPO / "hsdp_runner").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in lazy]
    assert not found, found


@pytest.fixture(scope="module")
def bad_files(corpus, tmp_path_factory):
    """Files a user could point data=hf at by mistake."""
    folder = tmp_path_factory.mktemp("bad")
    (folder / "empty.jsonl").write_text("")
    (folder / "small.jsonl").write_text('{"text": "doc1 the fox"}\n{"text": "doc2 a dog"}\n')
    lines = corpus.jsonl.read_text().splitlines()
    (folder / "corrupt.jsonl").write_text("\n".join(lines[:50] + ['{"text": "doc7 the'] + lines))
    (folder / "garbage.json").write_text("this is no tokenizer")
    return folder


# (overrides on top of a valid data=hf job, words the one-line message must contain)
BAD_HF_INPUTS = [
    (["data.path=/no/such.jsonl"], "data.path='/no/such.jsonl' does not exist"),
    (["data.path=null"], "data=hf needs data.path"),
    (["data.path=BAD/empty.jsonl"], "empty.jsonl is empty (no documents)"),
    (["data.path=BAD/corrupt.jsonl"], "corrupt.jsonl cannot be read (ArrowInvalid"),
    (["data.text_field=body"], "data.text_field='body' is not a column of data.path="),
    (["data.streaming=true", "data.text_field=body"], "data.text_field='body' is not a field"),
    (["data.split=validation"], "data.split='validation' is not a split of data.path"),
    (["data.tokenizer=/no/tokenizer.json"], "data.tokenizer='/no/tokenizer.json': does not exist"),
    (["data.tokenizer=BAD/garbage.json"], "cannot be read as a tokenizers file"),
    (["data.tokenizer=BAD"], "holds no tokenizer.json"),
    (["model.vocab_size=64"], "has 423 tokens, more than model.vocab_size=64"),
    (["data.bos_token='<bos>'"], "data.bos_token='<bos>' is not in the vocabulary"),
    (["data.path=BAD/small.jsonl"], "fewer than one global batch: trainer.global_batch_size=8"),
    (["trainer.val_every=2", "trainer.val_batches=40"], "fewer than the 40 held-out batches"),
    (["data.val_fraction=0"], "data.val_fraction=0.0 must lie between 0 and 1"),
]


@pytest.mark.parametrize(
    "overrides, words", BAD_HF_INPUTS, ids=[" ".join(case[0]) for case in BAD_HF_INPUTS]
)
def test_bad_data_input_exits_2_with_one_line_before_any_worker(
    overrides, words, corpus, bad_files, job_dir, monkeypatch, capsys
):
    from conftest import TINY
    from hf_corpus import hf_overrides
    from hydra.core.global_hydra import GlobalHydra

    from hsdp_runner.runtime import app

    overrides = [o.replace("BAD", str(bad_files)) for o in overrides]
    argv = [f"hydra.run.dir={job_dir}", *TINY, *hf_overrides(corpus), *overrides]
    monkeypatch.setattr("sys.argv", ["hsdp_runner", *argv])
    GlobalHydra.instance().clear()
    code = app.main()
    err = capsys.readouterr().err
    assert code == 2, err
    assert words in err and err.strip().count("\n") == 0, err
    assert not (job_dir / "logs").exists()


def test_the_last_validation_loss_goes_to_the_wandb_summary():
    from hsdp_runner.core.choices import RunStatus
    from hsdp_runner.core.records import RunSummary
    from hsdp_runner.train.sinks import wandb_summary

    assert wandb_summary(RunSummary(status=RunStatus.completed, val_loss=2.5))["val_loss"] == 2.5
    assert "val_loss" not in wandb_summary(RunSummary(status=RunStatus.completed))
