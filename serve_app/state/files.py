"""The files of the Batch API: uploads (purpose ``batch``) and the output and error files a batch
writes, on disk under one folder (``files_root``), each owned by the tenant of the key that made it.

A file is two entries in ``<root>/files``: its bytes (``<id>``) and its object (``<id>.json``,
OpenAI's ``file`` object plus its owner). A file exists once its object is written, atomically and
after its bytes: a result file that a runner is still appending to has no object yet, so it is not
listed and cannot be read. ``ResultFile`` is that appender: one JSON line per ``custom_id``,
fsynced, and on reopening it drops a torn last line and tells which ids are written already, so a
resumed batch answers no line twice.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve_app import errors
from serve_app.config import AppConfig

PURPOSES = ("batch", "batch_output")
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def files_root(cfg: AppConfig) -> Path:
    """``gateway.batch.files_dir``, else a ``batch`` folder beside the keys file: the run's state
    folder (``.local/`` for the embedded default, next to its Redis state). The batches' JSON
    documents (``state/batches.py``) live there too when there is no Redis."""
    configured = cfg.gateway.batch.files_dir
    if configured:
        return Path(configured).expanduser()
    return Path(cfg.gateway.keys.file).expanduser().resolve().parent / "batch"


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def valid_id(file_id: str) -> bool:
    """A file id as this store makes them: never a path (``..``, ``/``) into the folder."""
    return 0 < len(file_id) <= 64 and set(file_id) <= _ID_CHARS


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all, readable by this user only (0600, as the keys file):
    uploads are tenants' data."""
    tmp = path.with_name(path.name + f".{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FileStore:
    """Files on disk under ``root`` (one folder per gateway, shared by its replicas)."""

    def __init__(self, root: Path, clock: Callable[[], float] = time.time) -> None:
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.clock = clock

    def data_path(self, file_id: str) -> Path:
        return self.dir / file_id

    def _meta_path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.json"

    def create(self, owner: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        """Store an upload and return its file object."""
        file_id = new_id("file")
        write_atomic(self.data_path(file_id), data)
        return self.register(file_id, owner, filename, purpose)

    def register(self, file_id: str, owner: str, filename: str, purpose: str) -> dict[str, Any]:
        """Make the bytes already at ``data_path(file_id)`` a file (a finished result file)."""
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": self.data_path(file_id).stat().st_size,
            "created_at": int(self.clock()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        write_atomic(self._meta_path(file_id), json.dumps({**obj, "owner": owner}).encode())
        return obj

    def _load(self, file_id: str) -> dict[str, Any] | None:
        if not valid_id(file_id):
            return None
        try:
            loaded: dict[str, Any] = json.loads(self._meta_path(file_id).read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return loaded

    def get(self, owner: str, file_id: str) -> dict[str, Any]:
        """The file object, or 404 if there is none this owner may see (the two are not told
        apart, so a key cannot probe for another tenant's files)."""
        obj = self._load(file_id)
        if obj is None or obj.get("owner") != owner:
            raise errors.NotFound(f"No such File object: {file_id[:80]}", param="file_id",
                                  code="not_found")
        obj.pop("owner")
        return obj

    def content_path(self, owner: str, file_id: str) -> Path:
        self.get(owner, file_id)
        return self.data_path(file_id)

    def list(self, owner: str, purpose: str | None = None) -> list[dict[str, Any]]:
        """The owner's files, newest first."""
        found = []
        for meta in self.dir.glob("*.json"):
            obj = self._load(meta.stem)
            if obj is None or obj.pop("owner", None) != owner:
                continue
            if purpose is None or obj["purpose"] == purpose:
                found.append(obj)
        found.sort(key=lambda o: (o["created_at"], o["id"]), reverse=True)
        return found

    def delete(self, owner: str, file_id: str) -> dict[str, Any]:
        self.get(owner, file_id)
        self._meta_path(file_id).unlink(missing_ok=True)
        self.data_path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}


class ResultFile:
    """One result file of a batch (output or errors), appended one fsynced JSON line per answer.

    ``open`` must come first: it truncates a torn last line (a gateway killed mid-write) and
    returns the ``custom_id``s already written, which a resumed run skips."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self.lines = 0
        self.open_ids: set[str] = set()  # the custom_ids written before this run (``open``)

    def open(self, truncate: bool = False) -> set[str]:
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(self.path, flags, 0o600)
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)
        done: set[str] = set()
        self.lines = 0
        for line in data[:end].splitlines():
            self.lines += 1
            cid = json.loads(line).get("custom_id")
            if isinstance(cid, str):
                done.add(cid)
        self.open_ids = done
        return done

    def append(self, record: dict[str, Any]) -> None:
        assert self._fd is not None, "ResultFile.open first"
        os.write(self._fd, json.dumps(record, separators=(",", ":")).encode() + b"\n")
        os.fsync(self._fd)
        self.lines += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
