"""What each logits rule's test (penalties, token rules) checks of the jitted sampler: a
greedy draw picks the argmax of the logits the rule made, and the log-probabilities it
returns stay the model's own (vLLM's raw ones)."""

from __future__ import annotations

import jax
import numpy as np

from jserve.runners.sampling import sample_tokens


def assert_greedy_draw(logits: np.ndarray, expected: np.ndarray, **rules: object) -> None:
    """`sample_tokens` at temperature 0 with `rules` (its `penalties=` or `rules=`) against
    `expected`, the rule's logits computed by a reference."""
    rows = logits.shape[0]
    z = np.zeros(rows)
    tokens, logprobs = jax.jit(sample_tokens)(logits, z.astype(np.float32), np.ones(rows, np.float32),
                                              z.astype(np.int32), z.astype(np.uint32), z.astype(np.int32),
                                              **rules)
    assert np.asarray(tokens).tolist() == expected.argmax(-1).tolist()
    raw = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(np.asarray(logprobs), np.take_along_axis(raw, np.asarray(tokens)[:, None], -1)[:, 0],
                               rtol=1e-5, atol=1e-5)
