"""vLLM's logit_bias, bad_words and min_tokens in the jitted sampler: each slot of the
persistent batch has a row of values added to its logits (its biases, -inf for its banned
words) and a row of the ids it may not sample before its minimum length (EOS and its stop
ids), both written on the device once, when a sequence takes the slot; a step sends only
which rows to read (docs/serving.md, Sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jserve.engine.batch import TokenRuleSettings
from jserve.runners.slot_rows import padded_slots


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotRules:
    """Per slot: added to its logits (`bias`), and held back while it is short of its
    `min_tokens` (`stops`). Rows of sequences without rules are stale; a step reads a row
    only where its flags say (`TokenRules`)."""

    bias: jax.Array  # [slots, V] float32
    stops: jax.Array  # [slots, V] bool

    @classmethod
    def zeros(cls, slots: int, vocab: int) -> SlotRules:
        return cls(jnp.zeros((slots, vocab), jnp.float32), jnp.zeros((slots, vocab), bool))

    @property
    def num_slots(self) -> int:
        return self.bias.shape[0]


@jax.jit
def _set(state: SlotRules, slots: jax.Array, bias: jax.Array, stops: jax.Array) -> SlotRules:
    return SlotRules(state.bias.at[slots].set(bias, mode="drop"), state.stops.at[slots].set(stops, mode="drop"))


def set_rows(state: SlotRules, slots: np.ndarray, rules: TokenRuleSettings, which: np.ndarray) -> SlotRules:
    """Slots taken by new sequences with rules (`which` of `rules`' sequences, in `slots`):
    their rows written whole. Padded to a power of two of rows (padding rows out of range,
    dropped) so a few programs serve every count."""
    rows = padded_slots(slots, state.num_slots)
    shape = (len(rows), state.bias.shape[1])
    bias, stops = np.zeros(shape, np.float32), np.zeros(shape, bool)
    for i, j in enumerate(which.tolist()):
        bias[i, rules.bias_ids[j]] = rules.bias[j]
        stops[i, rules.stop_ids[j][rules.stop_ids[j] < shape[1]]] = True
    return _set(state, rows, bias, stops)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenRules:
    """A step's rules per sampled row, with the rows they read: `slot` is each row's row of
    `state`; `biased` adds its bias row, `early` (fewer output tokens than its
    `min_tokens`) bans its stop row."""

    state: SlotRules
    slot: jax.Array  # [S] int32
    biased: jax.Array  # [S] bool
    early: jax.Array  # [S] bool

    @property
    def active(self) -> jax.Array:
        """Whether any row has a rule this step (a bool scalar)."""
        return jnp.any(self.biased | self.early)


def apply_rules(logits: jax.Array, r: TokenRules) -> jax.Array:
    """vLLM's order: banned words and min_tokens' stop ids at -inf, then the biases (a
    ban is one here: its bias is -inf)."""
    logits = jnp.where(r.biased[:, None], logits + r.state.bias[r.slot], logits)
    return jnp.where(r.early[:, None] & r.state.stops[r.slot], -jnp.inf, logits)
