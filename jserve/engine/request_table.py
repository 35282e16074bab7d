"""Per-request scheduler fields as numpy columns (struct of arrays).

Policies scan every waiting and running request each step; keeping these fields in
columns makes a snapshot a handful of fancy-index copies (microseconds for thousands of
requests) instead of a Python loop over request objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np


def _col(dtype: type) -> np.ndarray:
    return field(metadata={"dtype": dtype})  # type: ignore[return-value]


@dataclass(frozen=True)
class RequestArrays:
    """One entry per request, aligned across fields."""

    seq_id: np.ndarray = _col(np.int64)
    status: np.ndarray = _col(np.int8)  # RequestStatus
    arrival_time: np.ndarray = _col(np.float64)
    prompt_len: np.ndarray = _col(np.int32)
    num_tokens: np.ndarray = _col(np.int32)  # prompt + generated so far
    num_computed: np.ndarray = _col(np.int32)  # tokens whose K/V is in the cache
    max_len: np.ndarray = _col(np.int32)  # num_tokens never exceeds this
    # KV blocks held on the device; for a request a cache feature keeps otherwise (layer
    # offload: some layers on the host) its logical blocks.
    num_blocks: np.ndarray = _col(np.int32)
    num_host_blocks: np.ndarray = _col(np.int32)  # KV blocks held in host memory (swapped)
    num_preemptions: np.ndarray = _col(np.int32)
    first_token_time: np.ndarray = _col(np.float64)  # nan until the first token
    last_token_time: np.ndarray = _col(np.float64)  # nan until the first token
    # Blocks a reserving policy has promised the request (its allocation, of which `num_blocks`
    # are materialised so far); 0 for policies that allocate block by block.
    reserved_blocks: np.ndarray = _col(np.int32)
    # Output length a predictor expects (0: no prediction), and the direction its
    # classifier expects the error to take: +1 over-predicted, -1 under, 0 unknown.
    predicted_len: np.ndarray = _col(np.int32)
    predicted_dir: np.ndarray = _col(np.int8)
    # Whether `predicted_len` is the output length itself, known from the request
    # (`jserve.engine.admission.known_prediction`), not a guess.
    length_known: np.ndarray = _col(np.bool_)
    # The client's latency targets in seconds (nan: none given), for SLO-aware policies.
    ttft_slo: np.ndarray = _col(np.float64)
    tbt_slo: np.ndarray = _col(np.float64)

    @classmethod
    def empty(cls, n: int) -> RequestArrays:
        return cls(**{f.name: np.zeros(n, f.metadata["dtype"]) for f in dataclasses.fields(cls)})

    def take(self, rows: np.ndarray) -> RequestArrays:
        # ndarray.take: half the time of fancy indexing, and a snapshot takes every column
        return RequestArrays(*[getattr(self, name).take(rows) for name in _FIELDS])

    def __len__(self) -> int:
        return len(self.seq_id)

    def with_status(self, status: int) -> np.ndarray:
        """Indices of entries in `status`, oldest arrival first (FCFS order)."""
        idx = np.flatnonzero(self.status == int(status))  # an IntEnum would slow numpy down
        return idx[np.argsort(self.arrival_time[idx], kind="stable")]


_FIELDS = tuple(f.name for f in dataclasses.fields(RequestArrays))


class RequestTable:
    """Rows of `RequestArrays` handed out to live requests and recycled when they end, and
    the cache features' own columns beside them (`columns`, by name: a feature adds its
    column when it is built, reads it with its rows, and shows it in its view section)."""

    def __init__(self, capacity: int = 256) -> None:
        self.data = RequestArrays.empty(capacity)
        self.columns: dict[str, np.ndarray] = {}
        self._defaults: dict[str, float | int] = {}
        self._live = np.zeros(capacity, dtype=bool)
        self._free_rows = list(range(capacity - 1, -1, -1))

    def add_column(self, name: str, dtype: type, default: float | int) -> None:
        """A cache feature's column, `default` for every request added; re-read it from
        `columns` after an `add` (the table may have grown into new arrays)."""
        if name in self.columns or name in _FIELDS:
            raise ValueError(f"the request table has a column {name!r} already")
        self.columns[name] = np.full(len(self._live), default, dtype)
        self._defaults[name] = default

    def add(self, **values: float | int) -> int:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._live[row] = True
        for f in dataclasses.fields(self.data):
            getattr(self.data, f.name)[row] = values.get(f.name, 0)
        for name, column in self.columns.items():
            column[row] = self._defaults[name]
        return row

    def remove(self, row: int) -> None:
        self._live[row] = False
        self._free_rows.append(row)

    @property
    def live_mask(self) -> np.ndarray:
        return self._live

    def __len__(self) -> int:
        return int(self._live.sum())

    def _grow(self) -> None:
        old = len(self._live)
        bigger = RequestArrays.empty(2 * old)
        for f in dataclasses.fields(bigger):
            getattr(bigger, f.name)[:old] = getattr(self.data, f.name)
        self.data = bigger
        for name, column in self.columns.items():
            self.columns[name] = np.concatenate([column, np.full(old, self._defaults[name], column.dtype)])
        self._live = np.concatenate([self._live, np.zeros(old, dtype=bool)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1))
