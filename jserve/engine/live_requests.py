"""The unfinished requests, findable the three ways the engine meets them: by the engine's
seq id (plans and batches), by the client's request id (aborts), and by their row of the
numpy columns the scheduler reads (everything vectorised).

Every part of the engine state reads and writes requests through this one registry, so
that a request is live in all three indexes or in none.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from itertools import repeat

import numpy as np

from jserve.engine.request import Request
from jserve.engine.request_table import RequestArrays, RequestTable


class LiveRequests:
    def __init__(self) -> None:
        self.table = RequestTable()
        self.requests: dict[int, Request] = {}  # by seq id
        self._row: dict[int, int] = {}  # seq id -> table row
        self._by_request_id: dict[str, int] = {}
        self._next_seq_id = 0
        # Requests not run since they arrived or were last preempted: the next plan that
        # runs one records when it was first scheduled and how long it waited preempted.
        self.awaiting_run: set[int] = set()
        # Requests whose every token must be looked at (text to detokenize, stop strings,
        # stop ids, an EOS they do not ignore); the others end by length alone.
        self.token_checked: set[int] = set()
        # Requests decoding under a grammar: each step's mask needs their last token read.
        self.constrained: set[int] = set()
        # Seq ids removed since the last `take_ended`: a runner holding per-sequence state
        # frees theirs.
        self._ended: list[int] = []

    @property
    def cols(self) -> RequestArrays:
        """The columns (re-read after an `add`: the table may have grown into new arrays)."""
        return self.table.data

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def membership(self) -> tuple[int, int]:
        """Changes whenever a request is added or removed: seq ids are never reused."""
        return self._next_seq_id, len(self.requests)

    def new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    def add(self, req: Request, token_checked: bool, **columns: float | int) -> None:
        self.requests[req.seq_id] = req
        self._by_request_id[req.request_id] = req.seq_id
        self._row[req.seq_id] = self.table.add(seq_id=req.seq_id, **columns)
        self.awaiting_run.add(req.seq_id)
        if token_checked:
            self.token_checked.add(req.seq_id)
        if req.matcher is not None:
            self.constrained.add(req.seq_id)

    def remove(self, req: Request) -> None:
        self.table.remove(self._row.pop(req.seq_id))
        del self.requests[req.seq_id]
        del self._by_request_id[req.request_id]
        self.awaiting_run.discard(req.seq_id)
        self.token_checked.discard(req.seq_id)
        self.constrained.discard(req.seq_id)
        self._ended.append(req.seq_id)

    def take_ended(self) -> list[int]:
        """Seq ids removed since the last call."""
        ended, self._ended = self._ended, []
        return ended

    def by_request_id(self, request_id: str) -> Request | None:
        seq_id = self._by_request_id.get(request_id)
        return None if seq_id is None else self.requests[seq_id]

    def row(self, seq_id: int) -> int:
        return self._row[seq_id]

    def rows(self, seq_ids: Collection[int]) -> np.ndarray:
        """Table rows of `seq_ids`, in their order; -1 for one that is not live."""
        return np.fromiter(map(self._row.get, seq_ids, repeat(-1)), np.int64, len(seq_ids))

    def token_checked_mask(self, seq_ids: Collection[int]) -> np.ndarray:
        """Which of `seq_ids` are in `token_checked`."""
        if not self.token_checked:
            return np.zeros(len(seq_ids), bool)
        return np.fromiter(map(self.token_checked.__contains__, seq_ids), bool, len(seq_ids))

    def live_rows(self) -> np.ndarray:
        return np.fromiter(self._row.values(), np.int64, len(self._row))

    def items(self) -> Iterator[tuple[int, int]]:
        """(seq id, row) of every live request."""
        return iter(self._row.items())
