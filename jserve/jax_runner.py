"""Runs a `Batch` through the model in one jit step on the device.

Shapes are padded to buckets so the step compiles a bounded number of times: tokens `T`
and sequences `S` are powers of two (at least 8) up to `max_num_batched_tokens` and
`max_num_seqs`. Context length is data, not shape (block tables are always
`max_blocks_per_seq` wide). `warmup()` compiles the buckets a vLLM-style schedule meets
(all-prefill steps with few sequences, all-decode steps with `T == S`); anything else
compiles on first use. The KV pages are donated to the step, so XLA writes new K/V in place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from jserve.batch import Batch, StepOutput
from jserve.sampling import sample_tokens
from jserve.scheduler_view import SchedulerLimits
from models.llama import LlamaForCausalLM
from models.paged import KVCache
from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.backends import select_attention

log = logging.getLogger(__name__)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    token_ids: jax.Array  # [T]
    meta: AttentionMetadata
    sample_index: jax.Array  # [S]: flat index of each sequence's last token
    temperature: jax.Array  # [S]
    top_p: jax.Array
    top_k: jax.Array
    seeds: jax.Array
    output_index: jax.Array


@dataclass(frozen=True)
class Buckets:
    max_tokens: int
    max_seqs: int
    max_blocks_per_seq: int

    @classmethod
    def for_limits(cls, limits: SchedulerLimits, block_size: int) -> Buckets:
        return cls(
            max_tokens=_pow2_at_least(limits.max_num_batched_tokens, 8),
            max_seqs=_pow2_at_least(limits.max_num_seqs, 8),
            max_blocks_per_seq=-(-limits.max_model_len // block_size),
        )

    def tokens(self, n: int) -> int:
        return min(_pow2_at_least(n, 8), self.max_tokens)

    def seqs(self, n: int) -> int:
        return min(_pow2_at_least(n, 8), self.max_seqs)

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """(T, S) pairs of all-prefill steps (up to 8 prompts, and up to 16 from 256 tokens:
        ShareGPT prefill steps average 9 prompts) and all-decode steps (T=S)."""
        sizes = sorted({self.tokens(2**i) for i in range(3, 20)})
        prefill = sorted({(t, s) for t in sizes
                          for s in (self.seqs(1), self.seqs(16) if t >= 256 else self.seqs(1))})
        decode = [(s, s) for s in sorted({self.seqs(2**i) for i in range(3, 20)})
                  if s <= self.max_tokens and (s, s) not in prefill]
        return prefill + decode

    def all_shapes(self) -> list[tuple[int, int]]:
        """Every (T, S) bucket a batch can fall in (S <= T: each sequence has a token), for
        loads whose prefill steps pack many prompts, such as a burst of short requests."""
        tokens = sorted({self.tokens(2**i) for i in range(3, 20)})
        seqs = sorted({self.seqs(2**i) for i in range(3, 20)})
        return [(t, s) for t in tokens for s in seqs if s <= t]


def build_step_inputs(batch: Batch, b: Buckets, bs: int, scratch_block: int) -> StepInputs:
    """Pad a batch to its bucket; padding tokens write to the scratch block, padded
    sequences are empty."""
    n, t_real = batch.num_seqs, batch.num_tokens
    t, s = b.tokens(t_real), b.seqs(n)
    q = batch.query_lens
    x = batch.inputs
    if x is None:
        raise ValueError("the JAX runner needs a batch built with inputs")

    tables = np.full((s, b.max_blocks_per_seq), scratch_block, np.int32)
    for i, table in enumerate(x.block_tables):
        tables[i, : len(table)] = table
    seq_of_token = np.repeat(np.arange(n), q)
    query_start = np.zeros(s + 1, np.int32)
    query_start[1 : n + 1] = np.cumsum(q)
    query_start[n + 1 :] = t_real
    positions = np.zeros(t, np.int32)
    positions[:t_real] = batch.start[seq_of_token] + np.arange(t_real) - query_start[seq_of_token]
    slots = np.full(t, scratch_block * bs, np.int32)
    pos = positions[:t_real]
    slots[:t_real] = tables[seq_of_token, pos // bs] * bs + pos % bs
    context_lens = np.zeros(s, np.int32)
    context_lens[:n] = batch.context_lens
    token_ids = np.zeros(t, np.int32)
    token_ids[:t_real] = x.token_ids
    sample_index = np.zeros(s, np.int32)
    sample_index[:n] = query_start[1 : n + 1] - 1

    def pad(a: np.ndarray, fill: float = 0) -> np.ndarray:
        out = np.full(s, fill, a.dtype)
        out[:n] = a
        return out

    meta = AttentionMetadata(positions, slots, query_start, context_lens, tables)
    return StepInputs(
        token_ids, meta, sample_index, pad(x.temperature), pad(x.top_p, 1.0),
        pad(x.top_k), pad(x.seeds), pad(x.output_index),
    )


class JaxRunner:
    needs_inputs = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        attention: str = "auto",
        kv_dtype: Any = None,
    ) -> None:
        cfg = model.cfg
        self.block_size = block_size
        self.buckets = Buckets.for_limits(
            SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_model_len), block_size)
        graphdef, self.params = nnx.split(model)
        dtype = kv_dtype or model.embed.embedding.get_value().dtype
        self.cache = KVCache.zeros(cfg, num_blocks, block_size, dtype)
        self.scratch_block = self.cache.scratch_block
        attention_fn = select_attention(attention)

        def step(params: Any, cache: KVCache, x: StepInputs) -> tuple[jax.Array, jax.Array, KVCache]:
            m = nnx.merge(graphdef, params)
            hidden, cache = m(x.token_ids, cache, x.meta, attention_fn)
            logits = m.logits(hidden[x.sample_index])
            tokens, logprobs = sample_tokens(
                logits, x.temperature, x.top_p, x.top_k, x.seeds, x.output_index
            )
            return tokens, logprobs, cache

        self._step = jax.jit(step, donate_argnums=(1,))
        self._compiled: set[tuple[int, int]] = set()
        self.warmed_up = False

    # ------------------------------------------------------------------ compile
    def warmup(self, progress: bool = False, shapes: list[tuple[int, int]] | None = None) -> float:
        """Compile `shapes` ((T, S) buckets; default: those a vLLM-style schedule uses);
        returns the seconds it took."""
        shapes = self.buckets.warmup_shapes() if shapes is None else shapes
        t0 = time.perf_counter()
        it = shapes
        if progress:
            from tqdm import tqdm

            it = tqdm(shapes, desc="compiling step buckets", unit="shape")
        for t, s in it:
            self._run(self._padding_inputs(t, s))
        self.warmed_up = True
        return time.perf_counter() - t0

    def _padding_inputs(self, t: int, s: int) -> StepInputs:
        """An all-padding batch of the given bucket: writes only the scratch block."""
        z = np.zeros
        meta = AttentionMetadata(
            positions=z(t, np.int32),
            slot_mapping=np.full(t, self.scratch_block * self.block_size, np.int32),
            query_start=z(s + 1, np.int32),
            context_lens=z(s, np.int32),
            block_tables=np.full((s, self.buckets.max_blocks_per_seq), self.scratch_block, np.int32),
        )
        return StepInputs(z(t, np.int32), meta, z(s, np.int32), z(s, np.float32),
                          np.ones(s, np.float32), z(s, np.int32), z(s, np.uint32), z(s, np.int32))

    # ------------------------------------------------------------------ execute
    def execute(self, batch: Batch) -> StepOutput:
        n = batch.num_seqs
        tokens, logprobs = self._run(build_step_inputs(batch, self.buckets, self.block_size, self.scratch_block))
        return StepOutput(next_tokens=np.asarray(tokens)[:n], logprobs=np.asarray(logprobs)[:n])

    def _run(self, x: StepInputs) -> tuple[jax.Array, jax.Array]:
        shape = (x.token_ids.shape[0], x.sample_index.shape[0])
        if shape not in self._compiled:
            if self.warmed_up:
                log.warning("compiling step for new bucket (T, S)=%s while serving", shape)
            self._compiled.add(shape)
        tokens, logprobs, self.cache = self._step(self.params, self.cache, x)
        return tokens, logprobs

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

