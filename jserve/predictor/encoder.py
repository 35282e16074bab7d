"""The frozen base model as a prompt encoder: one pooled vector per prompt.

The base is the serving model itself (`jserve.models.loading.load_model`), run through its paged
interface rather than a second transformer implementation: a batch of prompts is packed
onto one flat token axis, prefilled into a throwaway KV cache built inside the jit step,
and pooled. Packing (rather than padding every prompt to the longest) matters on CPU,
where the prefill is the whole cost of training: ShareGPT prompts vary from a few tokens
to the truncation limit, and padded tokens would be computed for nothing.

Shapes are bucketed to powers of two (tokens and sequences), so encoding a dataset
compiles once and a serving policy asking about one prompt at a time compiles a handful of
small shapes. The pooled representation is the final (normed) hidden state of the last
prompt token -- the state from which the model would emit its first reply token, hence the
one that has read the whole prompt -- and, with ``pooling="last+mean"``, the mean over the
prompt's tokens beside it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jserve.models.loading import LoadedModel
from jserve.models.paged import KVCache
from jserve.pallas_kernels.attention_metadata import AttentionMetadata, ragged_metadata
from jserve.pallas_kernels.backends import select_attention
from jserve.pallas_kernels.ragged_paged_attention import sequence_of_tokens

__all__ = ["EncoderConfig", "Pooling", "PromptEncoder", "truncate_prompt"]

Pooling = Literal["last", "last+mean"]

_BLOCK_SIZE = 16
_MIN_TOKEN_BUCKET = 16


@dataclass(frozen=True)
class EncoderConfig:
    """What the heads were trained on; a predictor must encode prompts the same way.

    `last+mean` is the default because the mean beside the last token lowered the
    CacheOpt head's MAE from 152 to 140 tokens on a validation split of the training
    prompts (1,573 train / 400 validation, max_prompt_len 128). `num_layers` runs only the
    base's first layers (then its final norm): None, all of them; fewer make encoding a
    large training set cheaper (measured rates and held-out cost:
    bench/results/issue43_predictor.md).
    """

    base_model: str = "smollm2-135m"
    max_prompt_len: int = 128
    pooling: Pooling = "last+mean"
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.max_prompt_len < 2:
            raise ValueError(f"max_prompt_len must be >= 2, got {self.max_prompt_len}")
        if self.pooling not in ("last", "last+mean"):
            raise ValueError(f"pooling must be 'last' or 'last+mean', got {self.pooling!r}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1 or None (all), got {self.num_layers}")

    def feature_dim(self, hidden_size: int) -> int:
        return hidden_size * (2 if self.pooling == "last+mean" else 1)

    def cache_key(self) -> dict[str, object]:
        """Everything that changes the features of a given prompt (for the on-disk cache)."""
        return {**asdict(self), "truncation": "head+tail"}


def truncate_prompt(ids: Sequence[int], max_len: int) -> list[int]:
    """Keep the first and the last `max_len // 2`-ish tokens of a long prompt.

    The head holds the system prompt and the start of the request (often the instruction);
    the tail holds the end of the request and the assistant header, from whose last token
    the reply would start. Dropping the middle keeps both.
    """
    ids = list(ids)
    if len(ids) <= max_len:
        return ids
    head = max_len // 2
    return ids[:head] + ids[len(ids) - (max_len - head):]


def _first_layers(model: nnx.Module, num_layers: int | None) -> nnx.Module:
    """`model` cut to its first `num_layers` blocks (copies of them), or itself."""
    if num_layers is None or num_layers == model.cfg.num_layers:
        return model
    if num_layers > model.cfg.num_layers:
        raise ValueError(f"num_layers={num_layers}, but {model.cfg.name} has "
                         f"{model.cfg.num_layers} layers")
    cut = nnx.merge(*nnx.split(model))
    graphdef, blocks = nnx.split(cut.layers)
    cut.layers = nnx.merge(graphdef, jax.tree.map(lambda x: x[:num_layers], blocks))
    cut.cfg = dataclasses.replace(cut.cfg, num_layers=num_layers)
    return cut


def _bucket(n: int, floor: int, cap: int) -> int:
    return min(max(floor, 1 << max(0, n - 1).bit_length()), cap)


class PromptEncoder:
    """Batched, jitted pooled features of prompts under the frozen base.

    `max_batch_tokens` bounds the packed token axis of one step (memory and the largest
    compiled shape); it must be a power of two (the attention reference tiles the token
    axis) that holds at least one truncated prompt.
    """

    def __init__(self, base: LoadedModel, config: EncoderConfig, *, max_batch_tokens: int = 1024,
                 max_batch_seqs: int = 16) -> None:
        if base.config.name != config.base_model:
            raise ValueError(f"encoder configured for {config.base_model!r}, "
                             f"got a loaded {base.config.name!r}")
        if max_batch_tokens & (max_batch_tokens - 1):
            raise ValueError(f"max_batch_tokens must be a power of two, got {max_batch_tokens}")
        if max_batch_tokens < config.max_prompt_len:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} cannot hold one prompt of "
                             f"max_prompt_len={config.max_prompt_len}")
        self.config = config
        self.feature_dim = config.feature_dim(base.config.hidden_size)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self._blocks_per_seq = math.ceil(config.max_prompt_len / _BLOCK_SIZE)
        self._graphdef, self._params = nnx.split(_first_layers(base.model, config.num_layers))

    def encode(self, prompts: Sequence[Sequence[int]], progress: bool = False) -> np.ndarray:
        """Features `[len(prompts), feature_dim]` (float32); prompts are truncated first."""
        out = np.zeros((len(prompts), self.feature_dim), np.float32)
        bar = tqdm(total=len(prompts), desc="encoding prompts", unit="prompt", disable=not progress)
        with bar:
            for start, batch in self._packed(prompts):
                out[start:start + len(batch)] = self._encode_packed(batch)
                bar.update(len(batch))
        return out

    def _packed(self, prompts: Sequence[Sequence[int]]) -> Iterator[tuple[int, list[list[int]]]]:
        """Consecutive runs of truncated prompts that fit one step, with their first index."""
        batch: list[list[int]] = []
        start = tokens = 0
        for i, ids in enumerate(prompts):
            if len(ids) == 0:
                raise ValueError(f"prompt {i} is empty")
            ids = truncate_prompt(ids, self.config.max_prompt_len)
            if batch and (tokens + len(ids) > self.max_batch_tokens
                          or len(batch) == self.max_batch_seqs):
                yield start, batch
                batch, start, tokens = [], i, 0
            batch.append(ids)
            tokens += len(ids)
        if batch:
            yield start, batch

    def _encode_packed(self, batch: list[list[int]]) -> np.ndarray:
        lens = np.array([len(ids) for ids in batch], np.int32)
        num_tokens = _bucket(int(lens.sum()), _MIN_TOKEN_BUCKET, self.max_batch_tokens)
        num_seqs = _bucket(len(batch), 1, self.max_batch_seqs)
        bps = self._blocks_per_seq
        meta = ragged_metadata(
            np.zeros(len(batch), np.int32), lens,
            [np.arange(i * bps, (i + 1) * bps, dtype=np.int32) for i in range(len(batch))],
            num_tokens=num_tokens, num_seqs=num_seqs, max_blocks=bps, block_size=_BLOCK_SIZE,
            scratch_block=num_seqs * bps,
        )
        token_ids = np.zeros(num_tokens, np.int32)
        token_ids[:lens.sum()] = np.concatenate(batch)
        features = _pooled_features(self._params, token_ids, meta, graphdef=self._graphdef,
                                    with_mean=self.config.pooling == "last+mean",
                                    blocks_per_seq=bps)
        return np.asarray(features)[:len(batch)]


@partial(jax.jit, static_argnames=("graphdef", "with_mean", "blocks_per_seq"))
def _pooled_features(params: nnx.State, token_ids: jax.Array, meta: AttentionMetadata, *,
                     graphdef: nnx.GraphDef, with_mean: bool, blocks_per_seq: int) -> jax.Array:
    """Prefill the packed prompts into a fresh cache and pool each one's hidden states.

    A module-level jit keyed by the model's graph (not a closure per encoder), so every
    predictor over the same base shares the compiled shapes.
    """
    model = nnx.merge(graphdef, params)
    num_seqs = meta.context_lens.shape[0]
    cache = KVCache.zeros(model.cfg, num_seqs * blocks_per_seq, _BLOCK_SIZE,
                          model.embed.embedding.get_value().dtype)
    hidden, _ = model(token_ids, cache, meta, select_attention("reference"))
    pooled = hidden[jnp.maximum(meta.query_start[1:] - 1, 0)]
    if with_mean:
        # Padding tokens belong to sequence `num_seqs`, which segment_sum drops.
        seq = sequence_of_tokens(meta.query_start, token_ids.shape[0])
        sums = jax.ops.segment_sum(hidden, seq, num_segments=num_seqs)
        pooled = jnp.concatenate([pooled, sums / jnp.maximum(meta.context_lens, 1)[:, None]],
                                 axis=-1)
    return pooled.astype(jnp.float32)
