"""Does data=hf's loader keep up with the step? Its tokens/s beside what a training step needs.

    .venv/bin/python benchmarks/data_loader.py [overrides ...] [--job DIR] [--steps 40]
        [--warmup 5] [--workers 0,2]

The overrides are a job's (``model=``, ``parallel=``, ``data.path=``, ``data.tokenizer=``,
``trainer.global_batch_size=`` ...). Without ``data.path`` a corpus (5,000 documents of
50-2,000 Zipf-distributed words) and a BPE tokenizer trained on it are made at run time.

1. The step's need: a finished job's ``summary.json`` (``--job DIR``), else a short job of the
   same overrides run here (``trainer.steps=12``): one rank's tokens per step (global batch /
   dp x seq_len) over its median step time after warm-up.
2. The loader's rate: one rank's stream (the lanes of dp rank 0 of the job's dp degree), read
   as fast as it makes batches, for each ``--workers`` value (0: the background thread with
   tokenizers' own threads; N: N DataLoader worker processes), after ``--warmup`` steps.

Prints one line per loader setting, ``loader ... tokens/s per rank  (x<ratio> the step's
need ...)``; a ratio above 1 means the step never waits for data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_corpus(folder: Path, docs: int = 5_000, seed: int = 0) -> tuple[Path, Path]:
    """A jsonl corpus of ``docs`` documents and a BPE tokenizer (8k) trained on it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "en", "or"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(5000)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(words))]
    path = folder / "corpus.jsonl"
    with open(path, "w") as out:
        for _ in range(docs):
            length = int(math.exp(rng.uniform(math.log(50), math.log(2000))))
            out.write(json.dumps({"text": " ".join(rng.choices(words, weights, k=length))}) + "\n")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train([str(path)], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return path, folder / "tokenizer.json"


def step_need(overrides: list[str], job: Path | None, tmp: Path) -> tuple[float, dict]:
    """(one rank's training tokens per second at the job's median step time, summary)."""
    if job is None:
        job = tmp / "job"
        cmd = [sys.executable, "-m", "hsdp_runner", f"hydra.run.dir={job}", *overrides]
        cmd += ["trainer.steps=12", "logger=none", "metrics.warmup_steps=4"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"the job failed ({result.returncode}):\n{result.stderr[-3000:]}")
    summary = json.loads((job / "summary.json").read_text())
    config = _resolved(job)
    rows = config["trainer"]["global_batch_size"] // summary["dp"]
    return rows * config["model"]["seq_len"] / summary["median_step_time_s"], summary


def _resolved(job: Path) -> dict:
    import yaml

    return yaml.safe_load((job / "config_resolved.yaml").read_text())


def loader_rate(cfg, dp: int, workers: int, steps: int, warmup: int) -> float:
    """Tokens/s (inputs) one rank's stream makes for ``cfg`` (a RunConfig) at dp ``dp``."""
    import dataclasses

    import torch

    from hsdp_runner.train.hf_batches import HFBatches

    data = dataclasses.replace(cfg.data, workers=workers)
    batches = HFBatches(
        data,
        cfg.model.vocab_size,
        cfg.model.seq_len,
        cfg.trainer.global_batch_size,
        0,
        dp,
        cfg.trainer.seed,
    )
    stream = batches.stream(0, torch.device("cpu"))
    try:
        for step in range(warmup):
            stream.get(step)
        start = time.perf_counter()
        tokens = 0
        for step in range(warmup, warmup + steps):
            inputs, _ = stream.get(step)
            tokens += inputs.numel()
        return tokens / (time.perf_counter() - start)
    finally:
        stream.close()


def main() -> None:
    """Parse the arguments, measure the need and the loader, print both."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--job", type=Path, help="a finished job dir: its step time is the need")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", default="0,2", help="data.workers values to measure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        overrides = list(args.overrides)
        if not any(o.startswith("data.path=") for o in overrides):
            corpus, tokenizer = make_corpus(tmp)
            print(f"corpus made at run time: {corpus} (5,000 documents), BPE 8k tokenizer")
            overrides += [
                "data=hf",
                f"data.path={corpus}",
                f"data.tokenizer={tokenizer}",
                f"data.cache_dir={tmp / 'cache'}",
                "model.vocab_size=8192",
            ]
        need, summary = step_need(overrides, args.job, tmp)
        from hsdp_runner.config.compose import compose, to_run_config

        cfg = to_run_config(compose(overrides))
        dp = summary["dp"]
        print(
            f"step's need: {need:,.0f} tokens/s per rank ({summary['layout']}, dp={dp}, "
            f"median step {summary['median_step_time_s']:.4f} s, "
            f"{summary['median_tps_per_device']:,.0f} tokens/s/device, {summary['device_name']})"
        )
        for workers in (int(w) for w in args.workers.split(",")):
            rate = loader_rate(cfg, dp, workers, args.steps, args.warmup)
            what = "background thread" if workers == 0 else f"{workers} worker processes"
            print(
                f"loader (data.workers={workers}: {what}): {rate:,.0f} tokens/s per rank  "
                f"(x{rate / need:.1f} the step's need)"
            )


if __name__ == "__main__":
    main()
