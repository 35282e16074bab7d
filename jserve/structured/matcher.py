"""One request's grammar state: which tokens may come next, advanced token by token; and
a step's bitmask, every constrained row of it computed at once."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import llguidance
import numpy as np


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask: bit `t % 32` of word `t // 32` allows token t
    (llguidance's layout, which the runner unpacks on the device)."""
    return -(-vocab_size // 32)


class GrammarMatcher:
    """A request's place in its grammar. The engine fills its row of the step's bitmask
    before the step and accepts the token the step sampled; once the grammar is complete
    (`is_terminated`) only EOS may follow, so an ordinary EOS stop ends the request."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (`bitmask_words(vocab_size)` int32)."""
        fill_bitmasks(row[None], [(self, 0)])

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar refuses it (the matcher then stays in
        error and allows nothing more but EOS)."""
        return self._matcher.consume_token(token)

    @property
    def is_terminated(self) -> bool:
        """The output is complete (or refused): nothing but EOS may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmasks(mask: np.ndarray, rows: Sequence[tuple[GrammarMatcher, int]]) -> None:
    """Each matcher's allowed next tokens into its row of `mask` ([S, words] int32,
    C-contiguous), the rows computed in parallel on llguidance's threads (without the
    GIL); rows no matcher names are left as they are."""
    global _executor
    if not rows:
        return
    words = bitmask_words(rows[0][0].vocab_size)
    if mask.dtype != np.int32 or mask.ndim != 2 or mask.shape[1] != words or not mask.flags.c_contiguous:
        raise ValueError(f"a step's bitmask is [rows, {words}] contiguous int32 words, got "
                         f"{mask.dtype} {mask.shape}")
    if not all(0 <= i < mask.shape[0] for _, i in rows):
        raise ValueError("a bitmask row outside the mask")
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m._matcher, i) for m, i in rows], mask.ctypes.data,
                                      mask.shape[1] * mask.itemsize, mask.shape[0])
