"""One request's grammar state: which tokens may come next, advanced token by token."""

from __future__ import annotations

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
        """Write the allowed next tokens into `row` (int32, `bitmask_words(vocab_size)`,
        contiguous)."""
        if row.dtype != np.int32 or row.shape != (bitmask_words(self.vocab_size),) or not row.flags.c_contiguous:
            raise ValueError(f"a bitmask row is {bitmask_words(self.vocab_size)} contiguous int32 words")
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

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
