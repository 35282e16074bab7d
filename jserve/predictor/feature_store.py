"""The frozen encoder's prompt features on disk: one encode pass over a dataset, reused by
every later run and head, and resumed where an interrupted pass stopped.

Encoding prompts through the base is the whole cost of training (the heads train in a minute),
so each prompt is encoded once per encoder configuration. A store is one directory per
configuration (`EncoderConfig.cache_key`: base model, truncation, pooling, layers) under
`~/.cache/jserve/predictor` (or `$JSERVE_PREDICTOR_CACHE`); inside it, shard files each hold
a chunk's prompt digests and features, written atomically as soon as the chunk is encoded.
A prompt is found by the digest of its token ids, not by its place in a dataset, so a larger
`--num-train`, another seed or another script reuses every prompt already encoded, and a
killed pass loses at most the chunk in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from jserve.predictor.encoder import EncoderConfig

__all__ = ["FeatureStore", "default_cache_dir", "prompt_digest"]

CHUNK = 256  # prompts per shard: a minute or two of CPU encoding lost at most on a kill
_DIGEST_BYTES = 16


class Encoder(Protocol):
    config: EncoderConfig

    def encode(self, prompts: Sequence[Sequence[int]], progress: bool = False) -> np.ndarray: ...


def default_cache_dir() -> Path:
    return Path(os.environ.get("JSERVE_PREDICTOR_CACHE",
                               os.path.expanduser("~/.cache/jserve/predictor")))


def prompt_digest(ids: Sequence[int]) -> bytes:
    """The key of one prompt: a digest of its (untruncated) token ids."""
    return hashlib.sha256(np.asarray(ids, np.int32).tobytes()).digest()[:_DIGEST_BYTES]


@dataclass(frozen=True)
class FeatureStore:
    """The features of one encoder configuration, kept in `directory`."""

    directory: Path

    @classmethod
    def of(cls, config: EncoderConfig, root: Path | None = None) -> FeatureStore:
        key = json.dumps(config.cache_key(), sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        store = cls((root or default_cache_dir()) / f"encoder-{digest}")
        store.directory.mkdir(parents=True, exist_ok=True)
        (store.directory / "encoder.json").write_text(key + "\n")  # what the digest stands for
        return store

    def load(self) -> dict[bytes, np.ndarray]:
        """Every stored prompt's features, by digest."""
        rows: dict[bytes, np.ndarray] = {}
        for path in sorted(self.directory.glob("shard-*.npz")):
            with np.load(path) as shard:
                for key, row in zip(shard["keys"], shard["features"], strict=True):
                    rows[key.tobytes()] = row
        return rows

    def features(self, encoder: Encoder, prompts: Sequence[Sequence[int]],
                 progress: bool = False) -> np.ndarray:
        """Features `[len(prompts), F]`, encoding (and storing, chunk by chunk) only the
        prompts the store does not hold yet."""
        keys = [prompt_digest(ids) for ids in prompts]
        rows = self.load()
        missing: dict[bytes, Sequence[int]] = {}
        for key, ids in zip(keys, prompts, strict=True):
            if key not in rows:
                missing.setdefault(key, ids)
        todo = list(missing.items())
        bar = tqdm(total=len(set(keys)), initial=len(set(keys)) - len(todo),
                   desc="encoding prompts", unit="prompt", disable=not progress)
        with bar:
            for start in range(0, len(todo), CHUNK):
                chunk = todo[start:start + CHUNK]
                encoded = encoder.encode([ids for _, ids in chunk])
                self._write([key for key, _ in chunk], encoded)
                rows.update(zip([key for key, _ in chunk], encoded, strict=True))
                bar.update(len(chunk))
        if not prompts:
            return np.zeros((0, 0), np.float32)
        return np.stack([rows[key] for key in keys]).astype(np.float32)

    def _write(self, keys: list[bytes], features: np.ndarray) -> None:
        name = f"shard-{uuid.uuid4().hex}"
        tmp = self.directory / f".{name}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, keys=np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), -1),
                     features=features.astype(np.float32))
        tmp.replace(self.directory / f"{name}.npz")  # atomic: a kill never leaves half a shard
