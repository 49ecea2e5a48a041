"""The tokenizer of ``data=hf``: a ``tokenizer.json`` read by Hugging Face ``tokenizers``.

``data.tokenizer`` names the file, or a folder holding it: a model's Hugging Face folder, or
the folder this runner exports (``checkpoint.export_at_end`` copies the job's tokenizer there).
Each document becomes ``[BOS] + ids + [EOS]``: the tokenizer's own special tokens
(post-processor) are not added, so a template that adds BOS itself adds nothing twice. BOS and
EOS are ``data.bos_token`` / ``data.eos_token``, else those ``tokenizer_config.json`` beside the
file names, else the first of the usual names the vocabulary holds (GPT-2's ``<|endoftext|>``
serves as both).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsdp_runner.config.schema import DataConfig
from hsdp_runner.core.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
USUAL_NAMES = {
    "bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]", "<|endoftext|>"),
    "eos": ("<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|endoftext|>"),
}


def tokenizer_file(data_cfg: DataConfig) -> Path:
    """The ``tokenizer.json`` that ``data.tokenizer`` names; ConfigError when there is none."""
    if not data_cfg.tokenizer:
        raise ConfigError(
            "data=hf needs data.tokenizer: set it to a tokenizer.json or a folder holding one "
            "(a Hugging Face model folder, or one this runner exported)"
        )
    path = Path(data_cfg.tokenizer).expanduser()
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no {TOKENIZER_FILE}" if path.is_dir() else "does not exist"
        raise ConfigError(
            f"data.tokenizer={data_cfg.tokenizer!r}: {where}; point it at a "
            f"{TOKENIZER_FILE} or a folder holding one"
        )
    return file


def load_tokenizer(file: Path, key_value: str):
    """A ``tokenizers.Tokenizer`` from ``file``; ConfigError naming ``key_value`` (the
    ``data.tokenizer=...`` the user wrote) when it cannot be read."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust side raises a bare Exception
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ConfigError(
            f"{key_value}: {file} cannot be read as a tokenizers file ({first}); point "
            f"data.tokenizer at a valid {TOKENIZER_FILE}"
        ) from None


def _configured(file: Path, which: str) -> str | None:
    """The ``<which>_token`` a tokenizer_config.json beside ``file`` names, if any."""
    config = file.parent / TOKENIZER_CONFIG
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get(f"{which}_token")
    except (OSError, ValueError):
        return None
    return value.get("content") if isinstance(value, dict) else value


def special_id(tokenizer, file: Path, data_cfg: DataConfig, which: str) -> int:
    """The id of the BOS (``which="bos"``) or EOS token; ConfigError when none is found."""
    key = f"data.{which}_token"
    asked = getattr(data_cfg, f"{which}_token")
    names = [asked] if asked else [_configured(file, which), *USUAL_NAMES[which]]
    for name in filter(None, names):
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
        if asked:
            raise ConfigError(
                f"{key}={asked!r} is not in the vocabulary of {file}; set {key} to one of its "
                "special tokens"
            )
    raise ConfigError(
        f"data.tokenizer={data_cfg.tokenizer!r} names no {which.upper()} token (no "
        f"{TOKENIZER_CONFIG} {which}_token, none of {', '.join(USUAL_NAMES[which])}); set {key}"
    )


@dataclass(frozen=True)
class TokenizerSpec:
    """A checked tokenizer: its file and BOS/EOS ids (picklable, for loader workers)."""

    file: str
    bos_id: int
    eos_id: int
    vocab_size: int


def check_tokenizer(data_cfg: DataConfig, vocab_size: int) -> TokenizerSpec:
    """Find, read and check ``data.tokenizer`` against ``model.vocab_size`` (``vocab_size``);
    return its spec. Raises ConfigError naming the key and the fix."""
    file = tokenizer_file(data_cfg)
    tokenizer = load_tokenizer(file, f"data.tokenizer={data_cfg.tokenizer!r}")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ConfigError(
            f"data.tokenizer={data_cfg.tokenizer!r} has {size} tokens, more than "
            f"model.vocab_size={vocab_size}; set model.vocab_size>={size} or use a smaller "
            "tokenizer"
        )
    bos, eos = (special_id(tokenizer, file, data_cfg, which) for which in ("bos", "eos"))
    return TokenizerSpec(str(file), bos, eos, size)


class Encoder:
    """Texts -> ``[BOS] + ids + [EOS]`` int32 arrays (an empty text: an empty array), by the
    tokenizer of ``spec``, read on first use (so an Encoder pickles small)."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self._tokenizer = None

    def __getstate__(self) -> dict:
        return {"spec": self.spec, "_tokenizer": None}

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        """Tokenize ``texts`` in one batch (tokenizers' Rust threads, the GIL released)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(Path(self.spec.file), "data.tokenizer")
        if not texts:
            return []
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        out = []
        for text, encoding in zip(texts, encode(texts, add_special_tokens=False)):
            if not text:
                out.append(np.zeros(0, dtype=np.int32))
                continue
            ids = encoding.ids
            tokens = np.empty(len(ids) + 2, dtype=np.int32)
            tokens[0], tokens[1:-1], tokens[-1] = self.spec.bos_id, ids, self.spec.eos_id
            out.append(tokens)
        return out


def export_tokenizer(spec: TokenizerSpec, folder: Path) -> None:
    """Copy the job's tokenizer into an exported model folder: ``tokenizer.json``, and the
    ``tokenizer_config.json`` beside it, or one naming BOS and EOS (so ``data.tokenizer``
    and ``transformers``' ``AutoTokenizer`` both read the folder)."""
    source = Path(spec.file)
    shutil.copyfile(source, folder / TOKENIZER_FILE)
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        if (source.parent / name).is_file():
            shutil.copyfile(source.parent / name, folder / name)
    if not (folder / TOKENIZER_CONFIG).is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(source))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tokenizer.id_to_token(spec.bos_id),
            "eos_token": tokenizer.id_to_token(spec.eos_id),
        }
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
