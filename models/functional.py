"""The model as pure functions over pytrees, for JAX programs: the same step the engine runs.

`PagedModel` is a model's static half (its structure, an `nnx.GraphDef`, and the attention
backend); the parameters (an `nnx.State`) and the paged KV cache (`KVCache`) are pytrees
passed in, and the cache comes back updated, so a call

    logits, cache = paged_model(params, cache, batch)

is a pure function a caller can put inside its own `jax.jit` (donating the cache), `vmap`
over parameters, or differentiate (through the `dense` attention backend:
`with_attention("dense")`). `jserve.runners.jax_runner.JaxRunner` runs its jit step
through these same functions: one implementation, whether the engine schedules the batches
or the caller does.

A `PagedBatch` is a flat ragged batch: the new tokens of every sequence one after another,
each sequence's position of its first new token and its block table. `make_batch` builds one
padded to power-of-two buckets, so a loop of steps compiles a few shapes, not one per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.models.config import ModelConfig
from jserve.models.loading import MODEL_CLASSES, CausalLM, abstract_model
from jserve.models.paged import AttentionFn, KVCache
from jserve.pallas_kernels.attention_metadata import AttentionMetadata, ragged_metadata
from jserve.pallas_kernels.backends import select_attention

__all__ = ["KVCache", "PagedBatch", "PagedModel", "check_token_ids", "decode_batch", "init", "make_batch",
           "paged_batch", "pow2_at_least", "split"]

Params = nnx.State


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedBatch:
    """One step's work: `token_ids [T]` (padding writes only the cache's scratch block),
    attention metadata (positions, block tables, lengths) and `sample_index [S]`, the flat
    index of each sequence's last token, whose logits the step returns."""

    token_ids: jax.Array
    meta: AttentionMetadata
    sample_index: jax.Array


def pow2_at_least(n: int, floor: int) -> int:
    """The bucket `n` pads to: a power of two, at least `floor`."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def paged_batch(token_ids: np.ndarray, start: np.ndarray, query_lens: np.ndarray,
                block_tables: Sequence[Sequence[int]] | np.ndarray, *, num_tokens: int, num_seqs: int,
                max_blocks: int, block_size: int, scratch_block: int,
                decode_only: bool = False) -> PagedBatch:
    """A batch padded to `num_tokens` tokens and `num_seqs` sequences: sequence `i` computes
    `query_lens[i]` tokens (of the flat `token_ids`) from position `start[i]`."""
    meta = ragged_metadata(start, query_lens, block_tables, num_tokens=num_tokens,
                           num_seqs=num_seqs, max_blocks=max_blocks, block_size=block_size,
                           scratch_block=scratch_block, decode_only=decode_only)
    n = len(query_lens)
    ids = np.zeros(num_tokens, np.int32)
    ids[: len(token_ids)] = token_ids
    sample_index = np.zeros(num_seqs, np.int32)
    sample_index[:n] = meta.query_start[1 : n + 1] - 1
    return PagedBatch(ids, meta, sample_index)


def make_batch(cache: KVCache, tokens: Sequence[Sequence[int]], start: Sequence[int],
               block_tables: Sequence[Sequence[int]], *, max_len: int, vocab_size: int,
               min_tokens: int = 8, min_seqs: int = 8) -> PagedBatch:
    """A step in which sequence `i` computes `tokens[i]` (a whole prompt, a chunk of one, or
    one decode token) from position `start[i]`, writing its K/V into the blocks of
    `block_tables[i]`, which must hold positions up to `start[i] + len(tokens[i])`.
    `max_len`: the longest a sequence gets (tables are padded to it, so steps share a shape).
    Tokens pad to a power of two of at least `min_tokens`, sequences to one of at least
    `min_seqs`: a prompt's bucket, passed to the decode steps too, makes one compiled shape
    of them all. Ids outside `[0, vocab_size)` raise here, where they are still numbers: the
    model would read an arbitrary embedding row for them without a word."""
    ids = [np.asarray(t, np.int32) for t in tokens]
    flat = np.concatenate(ids)
    check_token_ids(flat, vocab_size)
    lens = np.array([len(t) for t in ids], np.int32)
    block_size = cache.k.shape[2]
    return paged_batch(
        flat, np.asarray(start, np.int32),
        lens, [np.asarray(b, np.int32) for b in block_tables],
        num_tokens=pow2_at_least(int(lens.sum()), min_tokens),
        num_seqs=pow2_at_least(len(lens), min_seqs),
        max_blocks=-(-max_len // block_size), block_size=block_size,
        scratch_block=cache.scratch_block)


def check_token_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Raise `ValueError` naming the ids of `ids` outside `[0, vocab_size)`."""
    bad = np.unique(ids[(ids < 0) | (ids >= vocab_size)])
    if bad.size:
        raise ValueError(f"token ids {bad.tolist()} are outside the vocabulary [0, {vocab_size})")


def decode_batch(token_ids: jax.Array, positions: jax.Array, block_tables: jax.Array, *,
                 block_size: int, decode_only: bool = True) -> PagedBatch:
    """A decode step built from arrays, in jnp, so it can be made inside a caller's `jit`
    (a `lax.scan` or `fori_loop` decode): sequence `i` computes `token_ids[i]` at
    `positions[i]`, writing its K/V into `block_tables[i]` (`[S, max_blocks]`), which must
    hold that position. Nothing is padded: every row is a sequence. Token ids are the
    caller's to keep within the vocabulary (an id past it reads an arbitrary embedding row
    under jit, where `LLM` refuses it). `decode_only` lets a backend pick its decode kernel."""
    s = token_ids.shape[0]
    positions = positions.astype(jnp.int32)
    rows = jnp.arange(s)
    slots = block_tables[rows, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(positions, slots.astype(jnp.int32), jnp.arange(s + 1, dtype=jnp.int32),
                             positions + 1, block_tables.astype(jnp.int32), decode_only)
    return PagedBatch(token_ids.astype(jnp.int32), meta, rows.astype(jnp.int32))


@dataclass(frozen=True)
class PagedModel:
    """A model's structure and attention backend; hashable, so a jit may close over it."""

    graphdef: nnx.GraphDef
    attention: AttentionFn

    @classmethod
    def of(cls, cfg: ModelConfig, *, dtype: jnp.dtype = jnp.float32,
           attention: str | AttentionFn = "auto") -> PagedModel:
        """`cfg`'s structure alone, for parameters held elsewhere (a config and params:
        `PagedModel.of(cfg).bind(params)` is the Flax module to serve)."""
        return split(abstract_model(cfg, dtype), attention)[0]

    def with_attention(self, attention: str | AttentionFn) -> PagedModel:
        """The same model through another attention backend: `with_attention("dense")` is
        the one `jax.grad` can go through (the reference's loop bounds are data, the
        kernels alias their outputs); both compute the same values."""
        return replace(self, attention=_backend(attention))

    def bind(self, params: Params) -> CausalLM:
        """The Flax module of these parameters (e.g. to serve it: `LLM(model.bind(params))`)."""
        return nnx.merge(self.graphdef, params)

    def hidden_states(self, params: Params, cache: KVCache, batch: PagedBatch
                      ) -> tuple[jax.Array, KVCache]:
        """Final hidden states `[T, D]` of every token of the batch, and the updated cache."""
        return self.bind(params)(batch.token_ids, cache, batch.meta, self.attention)

    def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        """Float32 logits `[N, V]` of hidden states `[N, D]`."""
        return self.bind(params).logits(hidden)

    def __call__(self, params: Params, cache: KVCache, batch: PagedBatch
                 ) -> tuple[jax.Array, KVCache]:
        """Logits `[S, V]` of each sequence's last token (the next token's distribution), and
        the updated cache. Pure: `params`, `cache` and `batch` are pytrees."""
        hidden, cache = self.hidden_states(params, cache, batch)
        return self.logits(params, hidden[batch.sample_index]), cache


def split(model: CausalLM, attention: str | AttentionFn = "auto") -> tuple[PagedModel, Params]:
    """A Flax model (`load_model(...).model`, or one of yours) as (`PagedModel`, params).
    `attention`: a backend name ('auto': Pallas kernels on GPU, jnp reference elsewhere;
    'dense': differentiable) or an `AttentionFn`."""
    graphdef, params = nnx.split(model)
    return PagedModel(graphdef, _backend(attention)), params


def _backend(attention: str | AttentionFn) -> AttentionFn:
    return select_attention(attention) if isinstance(attention, str) else attention


def init(cfg: ModelConfig, *, seed: int = 0, dtype: jnp.dtype = jnp.float32,
         attention: str | AttentionFn = "auto") -> tuple[PagedModel, Params]:
    """A model of `cfg`'s shape with random parameters, as (`PagedModel`, params)."""
    return split(MODEL_CLASSES[cfg.family](cfg, dtype=dtype, rngs=nnx.Rngs(seed)), attention)
