"""``python -m hsdp_runner.export <checkpoint> <out_dir> [--dtype D] [--max-shard-gib G]``

Turns a training checkpoint (a ``step-N`` folder, or a folder of them: the newest complete one)
into a Hugging Face folder of the model's family that ``transformers`` loads
(``LlamaForCausalLM`` / ``GPT2LMHeadModel`` / ``Qwen3MoeForCausalLM.from_pretrained``):
consolidated ``model.safetensors`` (or shards + index above ``--max-shard-gib``) and
``config.json``. Runs in one process without a process group: DCP assembles the full tensors
from however many ranks' shards the checkpoint holds. Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hsdp_runner.checkpoint import hf
from hsdp_runner.checkpoint import start as checkpoint_start
from hsdp_runner.checkpoint.start import load_full_weights
from hsdp_runner.core.choices import Dtype
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.core.exit_codes import EXIT_CONFIG, EXIT_OK
from hsdp_runner.core.frozen_imports import freeze_imports
from hsdp_runner.models.base import model_spec
from hsdp_runner.models.params import torch_dtype


def export(
    source: Path, out_dir: Path, dtype: str = "bfloat16", max_shard_gib: float = 5.0
) -> list[Path]:
    """Export the checkpoint ``source`` names to the HF folder ``out_dir``; return weight files.

    Raises ConfigError (CheckpointError / HFFormatError) naming the path for bad input; an
    existing non-empty ``out_dir`` is never overwritten.
    """
    if dtype not in Dtype.names():
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(Dtype.names())}")
    if max_shard_gib <= 0:
        raise ConfigError(f"--max-shard-gib {max_shard_gib} must be positive")
    hf.require_empty_destination(out_dir, "export folder")
    path = checkpoint_start.resolve(source, "checkpoint")
    weights, manifest = load_full_weights(path)
    model_cfg = model_spec(manifest["model"])  # the family config its _target_ names
    return hf.write_export(weights, model_cfg, torch_dtype(dtype), out_dir, max_shard_gib)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m hsdp_runner.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", type=Path, help="a step-N checkpoint, or a folder of them")
    parser.add_argument("out_dir", type=Path, help="new (or empty) output folder")
    parser.add_argument("--dtype", default="bfloat16", choices=Dtype.names(), help="weight dtype")
    parser.add_argument(
        "--max-shard-gib",
        type=float,
        default=5.0,
        help="split into several files above this size (default 5)",
    )
    args = parser.parse_args(argv)
    try:
        files = export(args.checkpoint, args.out_dir, args.dtype, args.max_shard_gib)
    except ConfigError as err:
        print(f"hsdp_runner.export: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    print(
        f"hsdp_runner.export: wrote {len(files)} safetensors file(s) and config.json "
        f"({args.dtype}) to {args.out_dir}"
    )
    return EXIT_OK


if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
