"""Read the records of an offline W&B run file (`run-<id>.wandb`) to check what a run logged, without uploading.

The file is W&B's header (`:W&B`, magic, version) followed by LevelDB-log records (32 KiB blocks, each record
a 7-byte header: CRC32, length, type) holding `wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def run_info(path: Path) -> dict:
    """The run record (id, name, group) and the logged history rows as dicts."""
    info: dict = {"history": []}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run" and "run_id" not in info:
            info.update(run_id=record.run.run_id, name=record.run.display_name, group=record.run.run_group)
        elif kind == "history":
            info["history"].append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return info
