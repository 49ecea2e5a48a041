"""torchtitan's own trainer on synthetic tokens, for ``benchmarks/torchtitan_pair.py``.

    python -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/torchtitan_job.py \
        --metrics-jsonl <file> --mp fsdp|amp --dim 2048 --layers 16 --heads 32 --kv-heads 8 \
        --ffn-hidden 8192 --vocab 128256 --rope-theta 500000 -- <torchtitan CLI arguments>

Written for torchtitan 0.2.2 (PyPI; its trainer, config manager and llama3 model), with
torchtitan on ``PYTHONPATH``. The arguments before ``--`` are ours; the rest go to torchtitan's
``ConfigManager`` unchanged. Before calling torchtitan's ``main`` this module registers a train
spec, ``llama3_pair`` (torchtitan's llama3 spec with four parts swapped), whose only flavor,
``pair``, is the shape given here:

- **data**: random token ids (``SyntheticTokens``) through torchtitan's own
  ``ParallelAwareDataloader``: no dataset download, no tokenizer (torchtitan needs one only for
  flex/varlen attention masks; the model's vocabulary is ``--vocab`` either way). torchtitan's
  llama3 package imports Hugging Face ``datasets`` at import time for its C4 loader; where it
  is not installed a stand-in module is registered (nothing here calls it).
- **mixed precision** (``--mp``): ``fsdp`` wraps the model with torchtitan's own ``apply_fsdp``
  (embedding, each block, norm + output, root) on the one-rank world mesh, bf16 parameters and
  fp32 reduction, and turns off the autocast torchtitan uses without FSDP; ``amp`` is stock
  torchtitan on one GPU: fp32 parameters under ``torch.autocast(bfloat16)``.
- **metrics**: every logged step's figures (``throughput(tps)``, ``tflops``, ``mfu(%)``,
  ``memory/max_active(GiB)``, ``memory/max_reserved(GiB)``, loss, ...) as one JSON line each
  in ``--metrics-jsonl``, from torchtitan's ``MetricsProcessor`` (the console line has only the
  reserved memory).
- no validator, no state-dict adapter (no checkpoint is read or written).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import sys
import types

import torch

PAIR_SPEC = "llama3_pair"  # --model.name
PAIR_FLAVOR = "pair"  # --model.flavor
# torchtitan's SwiGLU width from dim: multiple_of x ceil(int(mult x int(8 dim / 3)) / multiple_of)
FFN_MULTIPLIERS = (1.5, 1.3, 1.2, 1.0, None)


def titan_ffn_hidden(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan llama3's FeedForward width (``FeedForward.__init__``) for ``dim``."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def ffn_args(dim: int, ffn_hidden: int) -> dict:
    """``ffn_dim_multiplier`` and ``multiple_of`` giving torchtitan's FFN ``ffn_hidden`` at
    ``dim`` (Llama 3.2 1B: 1.5 and 256 give 8192 at 2048); raises if none does."""
    for multiplier in FFN_MULTIPLIERS:
        for multiple_of in (256, 512, 1024, 4096):
            if titan_ffn_hidden(dim, multiplier, multiple_of) == ffn_hidden:
                return {"ffn_dim_multiplier": multiplier, "multiple_of": multiple_of}
    raise ValueError(f"no torchtitan FFN setting gives hidden {ffn_hidden} at dim {dim}")


def flavor_kwargs(a) -> dict:
    """``TransformerModelArgs`` keyword arguments of the benchmark's shape (``a``: our args)."""
    return {
        "dim": a.dim,
        "n_layers": a.layers,
        "n_heads": a.heads,
        "n_kv_heads": a.kv_heads,
        "vocab_size": a.vocab,
        "rope_theta": a.rope_theta,
        **ffn_args(a.dim, a.ffn_hidden),
    }


def _stand_in_datasets() -> None:
    """Register an empty ``datasets`` (and ``datasets.distributed``) module where Hugging Face
    datasets is not installed: torchtitan's llama3 package imports three names from it for its
    C4 loader, which this job never calls."""
    if importlib.util.find_spec("datasets") is not None:
        return

    def unavailable(*args, **kwargs):
        raise RuntimeError("datasets is not installed: this job trains on synthetic tokens")

    root = types.ModuleType("datasets")
    root.Dataset = type("Dataset", (), {})
    root.load_dataset = unavailable
    sub = types.ModuleType("datasets.distributed")
    sub.split_dataset_by_node = unavailable
    root.distributed = sub
    sys.modules.update({"datasets": root, "datasets.distributed": sub})


class SyntheticTokens(torch.utils.data.IterableDataset):
    """Endless ``({"input": ids[:-1]}, ids[1:])`` samples of ``seq_len + 1`` uniform token ids
    (torchtitan's sample format), seeded by the data-parallel rank."""

    def __init__(self, vocab: int, seq_len: int, rank: int):
        self.vocab, self.seq_len, self.rank = vocab, seq_len, rank

    def __iter__(self):
        gen = torch.Generator().manual_seed(1234 + self.rank)
        while True:
            ids = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=gen)
            yield {"input": ids[:-1]}, ids[1:]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class JsonlSink:
    """A torchtitan metric logger (``BaseLogger``'s interface) appending each step's metrics
    dict to a JSON-lines file, then passing it on to the logger it wraps."""

    def __init__(self, path: str, inner):
        self.path, self.inner = path, inner

    def log(self, metrics: dict, step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}))
            f.write("\n")
        self.inner.log(metrics, step)

    def close(self) -> None:
        self.inner.close()


def build_spec(a):
    """torchtitan's llama3 ``TrainSpec`` with our flavor, synthetic data, no tokenizer or
    validator, the metrics sink and (``a.mp == 'fsdp'``) one-rank FSDP mixed precision."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.metrics import build_metrics_processor
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models import llama3
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp, parallelize_llama
    from torchtitan.tools.logging import logger

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
        data = SyntheticTokens(a.vocab, job_config.training.seq_len, dp_rank)
        return ParallelAwareDataloader(
            data,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=job_config.training.local_batch_size,
        )

    def build_metrics(job_config, parallel_dims, *args, **kwargs):
        processor = build_metrics_processor(job_config, parallel_dims, *args, **kwargs)
        processor.logger = JsonlSink(a.metrics_jsonl, processor.logger)
        return processor

    def parallelize(model, parallel_dims, job_config):
        model = parallelize_llama(model, parallel_dims, job_config)
        if a.mp == "fsdp" and not parallel_dims.fsdp_enabled:
            training = job_config.training
            apply_fsdp(
                model,
                parallel_dims.world_mesh,
                param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
                pp_enabled=False,
            )
            logger.info("Applied FSDP (one rank: bf16 parameters, fp32 reduction) to the model")
        return model

    spec = llama3.get_train_spec()
    args = llama3.TransformerModelArgs(**flavor_kwargs(a))
    return dataclasses.replace(
        spec,
        model_args={PAIR_FLAVOR: args},
        parallelize_fn=parallelize,
        pipelining_fn=None,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=None,
        build_validator_fn=None,
        build_metrics_processor_fn=build_metrics,
        state_dict_adapter=None,
    )


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our arguments (before ``--``) and torchtitan's (after it)."""
    ours, titan = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--metrics-jsonl", required=True)
    p.add_argument("--mp", choices=("fsdp", "amp"), default="fsdp")
    for name, kind in (("dim", int), ("layers", int), ("heads", int), ("kv-heads", int)):
        p.add_argument(f"--{name}", type=kind, required=True)
    p.add_argument("--ffn-hidden", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--rope-theta", type=float, required=True)
    return p.parse_args(ours), titan


def main(argv: list[str]) -> None:
    """Register the spec, then run torchtitan's ``main`` on the torchtitan arguments."""
    a, titan_args = parse(argv)
    # ConfigManager.parse_args reads sys.argv[1:] as a default bound when torchtitan is
    # imported: set it first.
    sys.argv = [sys.argv[0], "--model.name", PAIR_SPEC, "--model.flavor", PAIR_FLAVOR]
    sys.argv += titan_args
    _stand_in_datasets()
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.train as titan_train
    from torchtitan.protocols.train_spec import register_train_spec

    register_train_spec(PAIR_SPEC, build_spec(a))
    if a.mp == "fsdp":
        # FSDP's MixedPrecisionPolicy casts; torchtitan would add autocast without FSDP.
        dist_utils.maybe_enable_amp = lambda *args, **kwargs: contextlib.nullcontext()
    titan_train.main(titan_train.Trainer)


if __name__ == "__main__":
    main(sys.argv[1:])
