"""Atomic file writes, one mechanism for every process, with the durability each caller names.

A reader sees the old content or the new, never half of either: the bytes go to a hidden temp
file in the same directory and are renamed over the target. What survives a crash depends on
the durability the caller asks for:

- ADVISORY: rename only. A process crash is safe; a power loss may leave the old content (or,
  on some filesystems, an empty file). For heartbeats, caches and the resolved-config copy.
- DURABLE: the temp file is fsynced before the rename, so a name never points at bytes that are
  not on disk. For cursors, offsets and state that a restart resumes from.
- DURABLE_DIR: DURABLE, and the directory is fsynced after the rename, so the rename itself
  survives a power loss. For checkpoints and published directories whose existence is the commit.

Beside them, `file_sha256`: the one hash of a file's bytes that what writes model directories records (the warm
start, `flywheel model fetch`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks (model weights are hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Durability(enum.Enum):
    ADVISORY = "advisory"
    DURABLE = "durable"
    DURABLE_DIR = "durable_dir"


def temp_path(path: Path) -> Path:
    """A hidden, unique sibling of `path` (same directory, so the rename stays atomic)."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str | Path, final: str | Path, durability: Durability) -> None:
    """Rename a finished temp file or directory over `final` with the given durability.

    For DURABLE and DURABLE_DIR every file directly inside a temp directory is fsynced first.
    """
    tmp, final = Path(tmp), Path(final)
    if durability is not Durability.ADVISORY:
        for path in (tmp.iterdir() if tmp.is_dir() else [tmp]):
            if path.is_file():
                fsync_path(path)
        if tmp.is_dir():
            fsync_path(tmp)
    os.replace(tmp, final)
    if durability is Durability.DURABLE_DIR:
        fsync_path(final.parent)


def write_with(path: str | Path, write: Callable[[Path], object], durability: Durability) -> Path:
    """Call `write(temp)` to produce the file, then publish it as `path`. The temp is removed on error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write(tmp)
        publish(tmp, path, durability)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_bytes(path: str | Path, data: bytes, durability: Durability) -> Path:
    return write_with(path, lambda tmp: tmp.write_bytes(data), durability)


def write_text(path: str | Path, text: str, durability: Durability) -> Path:
    return write_bytes(path, text.encode(), durability)


def write_json(path: str | Path, value: Any, durability: Durability, **dumps: Any) -> Path:
    return write_text(path, json.dumps(value, **dumps), durability)
