"""Derived dataset values kept on disk between runs (`~/.cache/jserve/datasets`, or
`$JSERVE_DATASET_CACHE`), keyed by digests of what they were derived from.

Entries are JSON, written to a temporary file and renamed into place, so a run killed
mid-write leaves no half entry; an entry that does not parse is treated as absent (the caller
recomputes and overwrites it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return Path(os.environ.get("JSERVE_DATASET_CACHE", os.path.expanduser("~/.cache/jserve/datasets")))


def file_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes (about 0.1 s per 100 MB), computed once per process for
    each version of the file."""
    st = os.stat(path)
    return _digest(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def key_digest(key: dict[str, Any]) -> str:
    """A short stable name for a JSON-able key."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def load_entry(path: Path) -> Any | None:
    """The JSON at `path`; None when there is none or it is corrupt (logged)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("ignoring unreadable cache entry %s (%s); recomputing it", path, e)
        return None


def save_entry(path: Path, value: Any) -> None:
    """Write `value` as JSON at `path` atomically: a temporary file beside it, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
