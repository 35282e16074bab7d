"""vLLM's repetition, frequency and presence penalties over per-sequence token counts held
on the device: each slot of the persistent batch has a row of output-token counts and a row
marking its prompt's tokens, which the jitted step updates from its own input tokens and the
sampler reads, so no history crosses from the host (docs/serving.md, Sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jserve.runners.slot_rows import padded_slots


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenCounts:
    """Per slot: how often each token was an output token fed to the model (`counts`), and
    whether it is in the prompt (`prompt`). Rows of sequences without penalties are stale."""

    counts: jax.Array  # [slots, V] int32
    prompt: jax.Array  # [slots, V] bool

    @classmethod
    def zeros(cls, slots: int, vocab: int) -> TokenCounts:
        return cls(jnp.zeros((slots, vocab), jnp.int32), jnp.zeros((slots, vocab), bool))

    @property
    def num_slots(self) -> int:
        return self.counts.shape[0]

    def counted(self, rows: jax.Array, ids: jax.Array) -> TokenCounts:
        """One more of token `ids[i]` in slot `rows[i]`; rows out of range are skipped."""
        return TokenCounts(self.counts.at[rows, ids].add(1, mode="drop"), self.prompt)


@jax.jit
def _reset(state: TokenCounts, slots: jax.Array, prompt: jax.Array) -> TokenCounts:
    return TokenCounts(state.counts.at[slots].set(0, mode="drop"),
                       state.prompt.at[slots].set(prompt, mode="drop"))


def reset_rows(state: TokenCounts, slots: np.ndarray, prompts: list[np.ndarray]) -> TokenCounts:
    """Slots taken by new sequences with penalties: no outputs yet, their prompts' tokens
    marked. Padded to a power of two of rows (padding rows out of range, dropped) so a few
    programs serve every count."""
    rows = padded_slots(slots, state.num_slots)
    mask = np.zeros((len(rows), state.prompt.shape[1]), bool)
    for i, p in enumerate(prompts):
        mask[i, p] = True
    return _reset(state, rows, mask)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Penalties:
    """A step's penalty settings per sampled row, with the counts they read: `slot` is each
    row's row of `state`. Presence and frequency 0 and repetition 1 leave a row alone."""

    state: TokenCounts
    slot: jax.Array  # [S] int32
    presence: jax.Array  # [S] float32
    frequency: jax.Array  # [S] float32
    repetition: jax.Array  # [S] float32

    @property
    def active(self) -> jax.Array:
        """Whether any row is penalised (a bool scalar)."""
        return jnp.any((self.presence != 0) | (self.frequency != 0) | (self.repetition != 1))


def apply_penalties(logits: jax.Array, p: Penalties) -> jax.Array:
    """vLLM's `apply_penalties`: a token seen in the prompt or the output has its logit
    divided by the repetition penalty where positive, multiplied where not; then the
    frequency penalty times its output count and the presence penalty once if it was
    output are subtracted."""
    counts = p.state.counts[p.slot]
    output = counts > 0
    seen = output | p.state.prompt[p.slot]
    r = jnp.where(seen, p.repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / r, logits * r)
    return logits - p.frequency[:, None] * counts - p.presence[:, None] * output
