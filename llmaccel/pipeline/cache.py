"""The artifact cache: a stage's output lives in `runs/<recipe>/<stage>-<key>/`, where the key
hashes the stage's config and the keys of its inputs, so a re-run redoes only what changed.
An external input (the model) is keyed by a fingerprint of its bytes (a hub id or benchmark
shape by its name). `stage.json` is written last, into a temporary directory renamed into
place: a directory without it was never finished and is never reused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from llmaccel.version import __version__

KEY_CHARS = 12          # of the sha256 hex digest, in directory names
STAGE_FILE = "stage.json"


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def stage_key(kind: str, config: dict[str, Any], inputs: dict[str, str]) -> str:
    """The cache key of a stage run: its kind, its settings and what it reads (input keys,
    text hashes). The code is part of it: a changed package recomputes rather than trusts."""
    blob = canonical({"kind": kind, "config": config, "inputs": inputs,
                      "llmaccel": code_version()})
    return hashlib.sha256(blob.encode()).hexdigest()


@lru_cache(maxsize=1)
def code_version() -> str:
    """The package version and a hash of its source files (an edited checkout is new code)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".cu", ".cuh", ".json", ".jsonl") and f.is_file() \
                and "__pycache__" not in f.parts:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return f"{__version__}+{h.hexdigest()[:12]}"


class Fingerprints:
    """Content hashes of files, remembered by (path, size, mtime) in `runs/.fingerprints.json`
    so an unchanged multi-GB checkpoint is not read again on every run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.memo: dict[str, str] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.memo = {}

    def of_model(self, model: str) -> str:
        """A key for the model argument: its bytes when it is a local file or directory,
        else its name (a hub id or a benchmark shape)."""
        p = Path(model)
        if p.is_file():
            return "file:" + self.of_file(p)
        if p.is_dir():
            h = hashlib.sha256()
            for f in sorted(q for q in p.rglob("*") if q.is_file()):
                h.update(f.relative_to(p).as_posix().encode() + b"\0")
                h.update(self.of_file(f).encode())
            return "dir:" + h.hexdigest()
        return "name:" + model

    def of_file(self, f: Path) -> str:
        st = f.stat()
        memo_key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if memo_key not in self.memo:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
            self.memo[memo_key] = h.hexdigest()
        return self.memo[memo_key]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.memo, indent=0))
        os.replace(tmp, self.path)


@dataclass
class StageRecord:
    """What `stage.json` holds: enough to reuse the output and to say where it came from."""
    name: str
    kind: str
    key: str
    config: dict[str, Any]
    inputs: dict[str, str]
    manifest: dict[str, Any] = field(default_factory=dict)  # the outputs, paths relative
    seconds: float = 0.0
    finished_at: str = ""
    llmaccel: str = __version__
    run_id: str = ""             # the `llmaccel run` that made it

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=True, default=str)


class Store:
    """The run directory of one recipe: `runs/<recipe>/`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def stage_dir(self, name: str, key: str) -> Path:
        return self.root / f"{name}-{key[:KEY_CHARS]}"

    def lookup(self, name: str, key: str) -> StageRecord | None:
        f = self.stage_dir(name, key) / STAGE_FILE
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        if data.get("key") != key:
            return None
        return StageRecord(**data)

    def begin(self, name: str, key: str) -> Path:
        """A fresh temporary directory for a stage's outputs (a leftover one is removed)."""
        tmp = self.root / f".tmp-{name}-{key[:KEY_CHARS]}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, record: StageRecord) -> Path:
        """Write stage.json last and move the outputs into place."""
        record.finished_at = time.strftime("%Y-%m-%dT%H:%M:%S")
        (tmp / STAGE_FILE).write_text(record.to_json())
        final = self.stage_dir(record.name, record.key)
        if final.exists():  # unfinished (no matching stage.json), or forced: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    def abandon(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["Fingerprints", "StageRecord", "Store", "canonical", "stage_key"]
