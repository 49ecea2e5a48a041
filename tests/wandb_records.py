"""Read an offline W&B run file (``run-<id>.wandb``) back into protobuf records, for tests.

wandb 0.31 has no public reader for offline runs and writes no config or summary files offline.
The file is a 7-byte header followed by LevelDB-log framing (32 KiB blocks; each chunk has a
4-byte checksum, 2-byte length and 1-byte type) around ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_records(path: str | Path):
    """Yield every ``Record`` message stored in the run file at ``path``."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            pending = chunk
        elif kind == FIRST:
            pending = chunk
            continue
        elif kind == MIDDLE:
            pending += chunk
            continue
        elif kind == LAST:
            pending += chunk
        else:
            break
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        yield record


def _key(item) -> str:
    # A flat key ("comm_measured/all_reduce/tp/bytes") and a nested one (the same figure inside
    # a logged dict) stay apart: nested parts are joined with "." (W&B's own summary view).
    return item.key or ".".join(item.nested_key)


def read_run(path: str | Path) -> dict:
    """Return {'group', 'name', 'tags', 'config', 'history', 'summary'} from a run file."""
    out = {"group": None, "name": None, "tags": [], "config": {}, "history": [], "summary": {}}
    for record in iter_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(
                group=record.run.run_group, name=record.run.display_name, tags=list(record.run.tags)
            )
            for item in record.run.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                out["summary"][_key(item)] = json.loads(item.value_json)
    return out
