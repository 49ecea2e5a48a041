"""The checks of ``data=hf`` made before any worker starts (``runtime/prelaunch.py``).

Each reads only what it must: the tokenizer, the head of the training documents (enough for
one global batch) and of the held-out ones (enough for the held-out batches), and a resumed
checkpoint's manifest. A failure is a ConfigError naming the key and the fix.
"""

from __future__ import annotations

from hsdp_runner.config.schema import DataConfig, TrainerConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.train.hf_source import SourceSpec, open_docs
from hsdp_runner.train.hf_tokenizer import Encoder, check_tokenizer
from hsdp_runner.train.lanes import DataError


def count_tokens(texts, encode: Encoder, need: int) -> int:
    """Tokens (with BOS/EOS) of ``texts`` in order, counted until ``need`` are reached."""
    total, batch = 0, []
    for text in texts:
        batch.append(text)
        if len(batch) == 64:
            total += sum(len(t) for t in encode(batch))
            batch = []
            if total >= need:
                return total
    return total + sum(len(t) for t in encode(batch))


def check_data(data_cfg: DataConfig, trainer: TrainerConfig, vocab_size: int, seq_len: int) -> None:
    """The checks of ``data=hf`` before any worker starts: tokenizer, path, split, text
    field, enough training tokens for one global batch, enough held-out tokens for
    ``trainer.val_batches`` / ``eval_batches``. Raises ConfigError naming key and fix."""
    if not data_cfg.path:
        raise ConfigError(
            "data=hf needs data.path: set it to a data file or folder (jsonl, json, parquet, "
            "arrow, csv, txt) or a Hugging Face hub dataset name"
        )
    spec = SourceSpec.from_config(data_cfg)
    encode = Encoder(check_tokenizer(data_cfg, vocab_size))
    batch_tokens = trainer.global_batch_size * (seq_len + 1)
    try:
        found = count_tokens(open_docs(spec, "train").iter_texts(), encode, batch_tokens)
        if found == 0:
            raise ConfigError(
                f"data.path={spec.path!r} holds no text in field data.text_field="
                f"{spec.text_field!r} of split {spec.split!r}: the dataset is empty; point "
                "data.path at data"
            )
        if found < batch_tokens:
            raise ConfigError(
                f"data.path={spec.path!r} holds {found} training tokens (split "
                f"{spec.split!r}{'' if spec.val_split else ' less the held-out documents'}), "
                f"fewer than one global batch: trainer.global_batch_size="
                f"{trainer.global_batch_size} x (model.seq_len+1)={batch_tokens}; use more "
                "data or lower trainer.global_batch_size"
            )
        held = max(trainer.val_batches if trainer.val_every else 0, trainer.eval_batches)
        need = held * batch_tokens
        if need:
            found = count_tokens(open_docs(spec, "val").iter_texts(), encode, need)
            if found < need:
                where = (
                    f"split {spec.val_split!r}"
                    if spec.val_split
                    else (f"data.val_fraction={spec.val_fraction} of split {spec.split!r}")
                )
                raise ConfigError(
                    f"the held-out documents ({where}) hold {found} tokens, fewer than the "
                    f"{held} held-out batches of trainer.val_batches/eval_batches need "
                    f"({need}); raise data.val_fraction, set data.val_split, or lower them"
                )
    except DataError as err:
        raise ConfigError(str(err)) from None


def check_resume(data_cfg: DataConfig, trainer: TrainerConfig, manifest: dict | None) -> None:
    """Refuse to resume a checkpoint (its ``manifest``) whose data=hf position cannot carry
    over: saved for another number of lanes (``trainer.global_batch_size``) or another
    ``data.shuffle_buffer``. Other differences are warned about when the job loads it."""
    saved = (manifest or {}).get("data", {})
    if "position" not in saved:
        return
    for key, ours in (
        ("trainer.global_batch_size", trainer.global_batch_size),
        ("data.shuffle_buffer", data_cfg.shuffle_buffer),
    ):
        theirs = saved.get(key.split(".")[1])
        if theirs is not None and theirs != ours:
            raise ConfigError(
                f"{key}={ours}, but the checkpoint to resume saved its data position with "
                f"{key}={theirs}; set {key}={theirs} to continue its data=hf stream exactly "
                "(or start afresh in another checkpoint.dir)"
            )
