"""Runs a `Batch` through the model on the device: one compiled program per token bucket,
with sampling and log-probabilities inside, the KV pages donated so XLA writes new K/V in
place, and `dispatch` returning before the device is done so the engine plans the next step
meanwhile. Buckets, variants, the token feed and layer staging: docs/serving.md, The JAX
runner.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from jserve.cache_features.protocol import StepContext, StepFeature
from jserve.cache_features.registry import build_step_features, refuse_unknown_steps
from jserve.engine.batch import Batch, BatchDelta, BatchSection, StepOutput, TopLogprobs
from jserve.engine.request import PLACEHOLDER
from jserve.engine.sampling_params import MAX_LOGPROBS
from jserve.engine.view import SchedulerLimits
from jserve.runners.executables import Executables, return_freed_memory
from jserve.runners.host_kv import HostKVStore
from jserve.runners.input_batch import INITIAL_SLOTS, NO_ROW, PersistentBatch
from jserve.runners.packed_inputs import Packed
from jserve.runners.penalties import Penalties, TokenCounts, reset_rows
from jserve.runners.sampling import sample_tokens
from jserve.runners.slot_rows import grown_rows
from jserve.runners.token_rules import SlotRules, TokenRules, set_rows
from jserve.runners.sharding import TensorParallel
from jserve.structured import bitmask_words
from jserve.models.functional import PagedBatch, PagedModel, paged_batch, pow2_at_least
from jserve.models.loading import CausalLM
from jserve.models.paged import KVCache
from jserve.pallas_kernels.backends import select_attention

log = logging.getLogger(__name__)


# Threads that compile or load warm-up buckets beside the one lowering them: XLA releases the
# GIL, and loading 14 cached steps took 5.7 s with two threads on two cores, 8.3 s with one.
COMPILE_THREADS = min(4, os.cpu_count() or 1)

# Prompts up to this many tokens (a chat turn) and up to this many decoding sequences run on
# the buckets a background warm-up builds before the server answers.
FIRST_TOKENS = 64
# The smallest token bucket: a decode of one sequence pads to it. On a GPU a decode of 16
# costs what one of 1 does (it reads the same weights); fewer buckets, fewer programs.
MIN_TOKENS = 16

# A compiled step's key: tokens T, whether it is an all-decode step (a backend with a decode
# kernel), and the cache feature whose sequences it has (its metadata differs), if any.
Shape = tuple[int, bool, str | None]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    """The model's batch (`jserve.models.functional`), each sequence's sampling settings,
    where the previous step's tokens feed this one, and which log-probabilities to return."""

    batch: PagedBatch
    temperature: jax.Array  # [S]
    top_p: jax.Array
    top_k: jax.Array
    seeds: jax.Array
    output_index: jax.Array
    feed: jax.Array  # [T] int32: row of the previous step's tokens to read; -1: `token_ids`
    next_token_ids: jax.Array  # [T]: read only when `want_positions`
    want_top: jax.Array  # bool scalar: top log-probabilities of the sampled positions
    want_positions: jax.Array  # bool scalar: and of every position (prompt log-probabilities)
    slot: jax.Array  # [S] int32: each sequence's row of the token counts
    presence: jax.Array  # [S] float32: penalties (`jserve.runners.penalties`)
    frequency: jax.Array
    repetition: jax.Array
    count_rows: jax.Array  # [T] int32: the counts' row each output token adds to (NO_ROW: none)
    biased: jax.Array  # [S] bool: add the slot's bias row (`jserve.runners.token_rules`)
    early: jax.Array  # [S] bool: short of its min_tokens, its stop ids banned


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepResult:
    """A step's device outputs, sliced and read by `PendingStep.result`."""

    tokens: jax.Array  # [S]
    logprobs: jax.Array  # [S]
    top: tuple[jax.Array, jax.Array]  # [S, K] ids and values (zeros unless asked)
    next_logprobs: jax.Array  # [T] (zeros unless asked)
    position_top: tuple[jax.Array, jax.Array]  # [T, K]


# Rows a top-k/top-p bisection passes over at once on a CPU, so that they stay in its cache
# across the passes (`sampling._bisected_cutoffs`); elsewhere the whole batch.
CPU_ROWS_PER_PASS = 2


def rows_per_pass(platform: str) -> int | None:
    """Rows a bisection passes over at once on `platform` (None: the whole batch)."""
    return CPU_ROWS_PER_PASS if platform == "cpu" else None


def _top(logits: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Log-softmax of `logits` [N, V] and its `MAX_LOGPROBS` largest entries (ids, values)."""
    lsm = jax.nn.log_softmax(logits.astype(jax.numpy.float32), axis=-1)
    values, ids = jax.lax.top_k(lsm, MAX_LOGPROBS)
    return lsm, (ids.astype(jax.numpy.int32), values)


def _no_top(n: int) -> tuple[jax.Array, jax.Array]:
    return (jax.numpy.zeros((n, MAX_LOGPROBS), jax.numpy.int32),
            jax.numpy.zeros((n, MAX_LOGPROBS), jax.numpy.float32))


@dataclass(frozen=True)
class Buckets:
    max_tokens: int
    max_seqs: int
    max_blocks_per_seq: int

    @classmethod
    def for_limits(cls, limits: SchedulerLimits, block_size: int) -> Buckets:
        return cls(
            max_tokens=pow2_at_least(limits.max_num_batched_tokens, MIN_TOKENS),
            max_seqs=pow2_at_least(limits.max_num_seqs, 8),
            max_blocks_per_seq=-(-limits.max_model_len // block_size),
        )

    def tokens(self, n: int) -> int:
        return min(pow2_at_least(n, MIN_TOKENS), self.max_tokens)

    def seqs(self, tokens: int) -> int:
        """Sequence rows of the `tokens` bucket: every sequence has a token, so no step of
        `tokens` tokens has more; one row count per bucket keeps one program per bucket."""
        return min(tokens, self.max_seqs)

    def shapes(self) -> list[int]:
        """Every token bucket a batch can fall in."""
        return sorted({self.tokens(2**i) for i in range(20)})


def first_shapes(shapes: list[int]) -> list[int]:
    """Of `shapes`, those one short request meets (prompts up to `FIRST_TOKENS`, decodes):
    a background warm-up builds these before the server answers, the rest after."""
    return [t for t in shapes if t <= FIRST_TOKENS]


def build_step_inputs(batch: Batch, b: Buckets, bs: int, held: PersistentBatch,
                      mark_decode: bool = False, feed: np.ndarray | None = None,
                      features: Sequence[tuple[StepFeature, object]] = ()) -> StepInputs:
    """Pad a batch to its bucket, its tables and sampling settings gathered from the
    sequences' slots of `held` (its delta applied); padding tokens write to the scratch
    block, padded sequences are empty. `mark_decode` sets `meta.decode_only` on all-decode
    steps, for backends with a decode kernel. `feed` ([num_tokens]): the previous step's row
    each token is read from (-1: the batch's own id). `features`: the runner's cache
    features with what each prepared for this step (`StepFeature.before_compute`), which
    change their sequences' tables and metadata."""
    n = batch.num_seqs
    t = b.tokens(batch.num_tokens)
    s = b.seqs(t)
    q = batch.query_lens
    x = batch.inputs
    if x is None:
        raise ValueError("the JAX runner needs a batch built with inputs")

    slots = held.slots(batch.seq_ids.tolist())
    tables = held.tables[slots]
    for feature, _ in features:
        tables = feature.tables(batch, tables)
    step = paged_batch(
        x.token_ids, batch.start, q, tables, num_tokens=t, num_seqs=s,
        max_blocks=b.max_blocks_per_seq, block_size=bs, scratch_block=held.scratch_block,
        decode_only=mark_decode and bool(np.all(q == 1)),
    )
    meta = step.meta
    for feature, prepared in features:
        meta = feature.metadata(batch, meta, lambda i: held.table(int(slots[i])), prepared)

    def pad(a: np.ndarray, fill: float = 0) -> np.ndarray:
        out = np.full(s, fill, a.dtype)
        out[:n] = a
        return out

    count_rows = np.full(t, NO_ROW, np.int32)
    count_rows[:batch.num_tokens] = held.count_rows(slots, batch.start, q)
    next_ids = np.zeros(t, np.int32)
    if x.next_token_ids is not None:
        next_ids[:batch.num_tokens] = x.next_token_ids
    fed = np.full(t, -1, np.int32)
    if feed is not None:
        fed[:batch.num_tokens] = feed
    if meta is not step.meta:
        step = dataclasses.replace(step, meta=meta)
    return StepInputs(step, pad(held.temperature[slots]), pad(held.top_p[slots], 1.0),
                      pad(held.top_k[slots]), pad(held.seeds[slots]),
                      pad(x.output_index), fed, next_ids, np.bool_(x.logprobs),
                      np.bool_(x.next_token_ids is not None), pad(slots.astype(np.int32)),
                      pad(held.presence[slots]), pad(held.frequency[slots]),
                      pad(held.repetition[slots], 1.0), count_rows, pad(held.biased[slots]),
                      pad(x.output_index < held.min_tokens[slots]))


def _sub_batch(batch: Batch, rows: np.ndarray) -> Batch:
    """The sequences `rows` (consecutive) of a batch whose copies are done and whose delta
    is applied: their tokens."""
    x, lo, hi = batch.inputs, int(rows[0]), int(rows[-1]) + 1
    offsets = np.concatenate([[0], np.cumsum(batch.query_lens)])
    t0, t1 = int(offsets[lo]), int(offsets[hi])
    inputs = dataclasses.replace(
        x, token_ids=x.token_ids[t0:t1], output_index=x.output_index[lo:hi],
        next_token_ids=None if x.next_token_ids is None else x.next_token_ids[t0:t1],
        token_mask=None if x.token_mask is None else x.token_mask[lo:hi])
    return Batch(seq_ids=batch.seq_ids[lo:hi], start=batch.start[lo:hi], query_lens=batch.query_lens[lo:hi],
                 sample=batch.sample[lo:hi], inputs=inputs, features=_sliced(batch.features, lo, hi))


def _sliced(features: Mapping[str, BatchSection], lo: int, hi: int) -> dict[str, BatchSection]:
    """The cache features' parts for sequences `lo:hi`."""
    parts = ((name, section.sliced(lo, hi)) for name, section in features.items())
    return {name: part for name, part in parts if part is not None}


def _concat_outputs(outs: list[StepOutput]) -> StepOutput:
    """One step's output from those of its consecutive groups of sequences."""
    def cat(xs: list[Any]) -> Any:
        if xs[0] is None:
            return None
        if isinstance(xs[0], TopLogprobs):
            return TopLogprobs(cat([x.token_ids for x in xs]), cat([x.logprobs for x in xs]))
        if isinstance(xs[0], tuple):
            return tuple(cat(list(parts)) for parts in zip(*xs))
        return np.concatenate(xs)

    return StepOutput(next_tokens=cat([o.next_tokens for o in outs]), logprobs=cat([o.logprobs for o in outs]),
                      top_logprobs=cat([o.top_logprobs for o in outs]),
                      position_logprobs=cat([o.position_logprobs for o in outs]))


def _jit_step(model: PagedModel, treedef: Any, platform: str,
              shardings: tuple[Any, Any] | None = None) -> Callable[..., Any]:
    """The step of a model structure: model, sampling and log-probabilities in one program.
    `shardings`: its (in, out) over a mesh. The step's `StepInputs` arrive packed in one
    buffer (`Packed`). `allowed`: the grammar bitmask of the step's rows, whether to apply
    it, and the slots' biases and bans (`JaxRunner._allowed`)."""
    jnp = jax.numpy

    def step(weights: list[jax.Array], cache: KVCache, fed: jax.Array, counts: TokenCounts,
             packed: Packed, allowed: tuple[jax.Array, jax.Array, SlotRules]
             ) -> tuple[StepResult, KVCache, jax.Array, TokenCounts]:
        params = jax.tree.unflatten(treedef, weights)
        x: StepInputs = packed.unpack()
        ids = jnp.where(x.feed >= 0, fed[jnp.maximum(x.feed, 0)], x.batch.token_ids)
        counts = counts.counted(x.count_rows, ids)
        batch = dataclasses.replace(x.batch, token_ids=ids)
        hidden, cache = model.hidden_states(params, cache, batch)
        logits = model.logits(params, hidden[batch.sample_index])
        tokens, logprobs = sample_tokens(logits, x.temperature, x.top_p, x.top_k, x.seeds,
                                         x.output_index, rows_per_pass=rows_per_pass(platform),
                                         token_mask=allowed[0], masked=allowed[1],
                                         penalties=Penalties(counts, x.slot, x.presence, x.frequency,
                                                             x.repetition),
                                         rules=TokenRules(allowed[2], x.slot, x.biased, x.early))
        s, t = logits.shape[0], ids.shape[0]
        top = jax.lax.cond(x.want_top, lambda: _top(logits)[1], lambda: _no_top(s))

        def positions() -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            lsm, position_top = _top(model.logits(params, hidden))
            return jnp.take_along_axis(lsm, x.next_token_ids[:, None], axis=-1)[:, 0], position_top

        next_lp, position_top = jax.lax.cond(
            x.want_positions, positions, lambda: (jnp.zeros(t, jnp.float32), _no_top(t)))
        fed = jax.lax.dynamic_update_slice(fed, tokens, (0,))
        return StepResult(tokens, logprobs, top, next_lp, position_top), cache, fed, counts

    placed = {} if shardings is None else {"in_shardings": shardings[0], "out_shardings": shardings[1]}
    return jax.jit(step, donate_argnums=(1, 2, 3), **placed)


# One device: the step of a model structure jitted once per process. Runners of the same
# structure (a process comparing policies, a test suite) share it, so JAX's caches find a
# bucket's step traced, lowered and compiled by an earlier runner.
_shared_step = functools.cache(_jit_step)


@dataclass
class PendingStep:
    """A dispatched step: its outputs stay on the device until `result()` reads them."""

    result_on_device: StepResult | None
    num_seqs: int
    num_tokens: int
    logprobs: bool
    positions: bool
    _done: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._done is None:
            self._done = self._read()
        return self._done

    def _read(self) -> StepOutput:
        r, n, t = self.result_on_device, self.num_seqs, self.num_tokens
        if r is None:
            return StepOutput.empty()
        top = positions = None
        if self.logprobs:
            top = TopLogprobs(np.asarray(r.top[0])[:n], np.asarray(r.top[1])[:n])
        if self.positions:
            positions = (np.asarray(r.next_logprobs)[:t],
                         TopLogprobs(np.asarray(r.position_top[0])[:t], np.asarray(r.position_top[1])[:t]))
        return StepOutput(next_tokens=np.asarray(r.tokens)[:n], logprobs=np.asarray(r.logprobs)[:n],
                          top_logprobs=top, position_logprobs=positions)


def _ready(out: StepOutput) -> PendingStep:
    return PendingStep(None, out.next_tokens.shape[0], 0, False, False, out)


class JaxRunner:
    needs_inputs = True

    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        attention: str = "auto",
        kv_dtype: Any = None,
        tensor_parallel: TensorParallel | None = None,
        **feature_options: object,
    ) -> None:
        """`tensor_parallel`: run the step over its mesh (`jserve.runners.sharding`): weights
        split Megatron-style, the cache by KV head, attention per shard.
        `feature_options`: the cache features' runner options
        (`jserve.cache_features.registry.build_step_features`: `layer_staging` and
        `num_host_blocks` for LayerKV's layer offload, `hidden_steps` for Apt-Serve's hidden
        cache); each feature the engine will use adds its compiled variant of every step."""
        tp = tensor_parallel
        if tp is not None:
            model = tp.prepare(model)
        cfg = model.cfg
        self.block_size = block_size
        self.buckets = Buckets.for_limits(
            SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_model_len), block_size)
        graphdef, self.params = nnx.split(model)
        if tp is not None:
            self.params = tp.place_params(self.params)
        dtype = kv_dtype or model.embed.embedding.get_value().dtype
        attention_fn = select_attention(attention)
        if tp is not None:
            attention_fn = tp.attention(attention_fn)
        self.features = build_step_features(StepContext(
            cfg, block_size, num_blocks, max_model_len, self.buckets.max_tokens,
            self.buckets.max_seqs, attention_fn, np.dtype(dtype), tp and tp.pages), **feature_options)
        self.cache = KVCache.zeros(cfg, num_blocks, block_size, dtype,
                                   staging_blocks=sum(f.extra_blocks() for f in self.features),
                                   sharding=tp and tp.cache)
        self.scratch_block = self.cache.scratch_block
        for feature in self.features:
            feature.bind(self.scratch_block)
            attention_fn = feature.wrap_attention(attention_fn)
        width = max([self.buckets.max_blocks_per_seq, *(f.table_width() for f in self.features)])
        # As many slots as a step's sequences, so that the token counts (sized by them)
        # change shape, and the steps compile again, only when preempted sequences pile up.
        self.held = PersistentBatch(width, self.scratch_block, max(INITIAL_SLOTS, self.buckets.max_seqs))
        self.mark_decode = attention_fn.specialises_decode
        self.host_kv = HostKVStore(attention_fn.gather_blocks, attention_fn.scatter_blocks, tp and tp.pages)
        # The step takes the weights as a flat list: flattening the nnx.State tree on every
        # call cost ~0.25 ms. The model runs through `jserve.models.functional`, as a JAX
        # user's own jit would.
        self._weights, treedef = jax.tree.flatten(self.params)
        model = PagedModel(graphdef, attention_fn)
        platform = (next(iter(tp.mesh.devices.flat)).platform if tp is not None else jax.default_backend())
        # The previous step's sampled tokens, which the next step may read (`PendingStep`).
        self._fed = jax.device_put(np.zeros(self.buckets.max_seqs, np.int32), tp and tp.replicated)
        self._fed_rows: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._counts = jax.device_put(TokenCounts.zeros(self.held.capacity, cfg.vocab_size), tp and tp.replicated)
        self._rules = jax.device_put(SlotRules.zeros(self.held.capacity, cfg.vocab_size), tp and tp.replicated)

        # Over a mesh: compiled once for all devices, weights and cache where they lie, the
        # batch replicated; the cache comes back as it went in, so its donation aliases.
        if tp is None:
            self._step = _shared_step(model, treedef, platform)
        else:
            cache_at = tp.cache_shardings(self.cache)
            self._step = _jit_step(
                model, treedef, platform,
                (([w.sharding for w in self._weights], cache_at, tp.replicated, tp.replicated,
                  tp.replicated, tp.replicated),
                 (tp.replicated, cache_at, tp.replicated, tp.replicated)))
        self._executables = Executables()
        # What the step is lowered for: the cache's shapes, not its arrays, which the engine
        # thread donates to each step while a background compile lowers other buckets.
        self._cache_spec = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.cache)
        self._fed_spec = jax.ShapeDtypeStruct(self._fed.shape, self._fed.dtype, sharding=self._fed.sharding)
        # A step no grammar constrains passes an all-ones bitmask already on the device, one
        # per row bucket, so it sends nothing more than it did without grammars.
        self._mask_words = bitmask_words(cfg.vocab_size)
        self._unmasked = functools.cache(lambda s: jax.device_put(
            np.full((s, self._mask_words), -1, np.int32), self._fed.sharding))
        self._warmup_started = False

    # ------------------------------------------------------------------ compile
    def warmup(self, progress: bool = False, shapes: list[int] | None = None,
               background: bool = False) -> float:
        """Compile the steps of the token buckets `shapes` (default: all of them), or load
        them from the persistent compile cache; returns the seconds it took.

        No step runs: executing a padding batch per bucket cost more than loading its step.
        Cache features' own copies (LayerKV's, small jits, one per padded size) do run, on the
        scratch block.
        Tracing and lowering (Python) happen here while worker threads compile or load the
        buckets already lowered (XLA, which releases the GIL), so they overlap.

        `background`: compile only what one short request needs now (`first_shapes`) and
        the rest on threads of their own, smallest first, so a server answers early; a step
        that meets a bucket not built yet builds it (or waits for the background's build)
        first. `warmed_up` turns true, and `wait_warmup()` returns, once all are built.
        """
        shapes = self.buckets.shapes() if shapes is None else shapes
        first = first_shapes(shapes) if background else shapes
        t0 = time.perf_counter()
        with ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="jserve-compile") as pool:
            pending: dict[Shape, Future[jax.stages.Compiled]] = {}
            for shape in self._variants(first):
                if shape not in self._executables and shape not in pending:
                    pending[shape] = pool.submit(self._build, self._padding_inputs(*shape))
            done = as_completed(pending.values())
            if progress:
                from tqdm import tqdm

                done = tqdm(done, total=len(pending), desc="compiling step buckets", unit="shape")
            for _ in done:
                pass
        for shape, f in pending.items():
            self._executables.put(shape, f.result())
        for feature in self.features:
            self.cache = feature.warm_up(self.cache)
        rest = [(shape, lambda shape=shape: self._build(self._padding_inputs(*shape)))
                for shape in self._variants(sorted(set(shapes) - set(first)))
                if shape not in self._executables]
        if rest:
            self._executables.build_in_background(rest, COMPILE_THREADS)
        else:
            return_freed_memory()
        self._warmup_started = True
        return time.perf_counter() - t0

    @property
    def warmed_up(self) -> bool:
        """Warm-up has run, its background compiles (if any) included."""
        return self._warmup_started and not self._executables.building_in_background

    def wait_warmup(self) -> None:
        """Until a background warm-up has compiled every bucket."""
        self._executables.wait()

    def _variants(self, shapes: list[int]) -> list[Shape]:
        """The steps each token bucket serves, as (T, decode_only, feature): with a decode
        kernel, all-decode steps compile apart; each cache feature adds steps that have its
        sequences (one feature a step: a policy uses one feature)."""
        return [(t, d, f) for t in shapes
                for d in ((False, True) if self.mark_decode and t <= self.buckets.tokens(self.buckets.max_seqs)
                          else (False,))
                for f in (None, *(feature.name for feature in self.features if feature.compiled_ahead))]

    def _shape_of(self, x: StepInputs) -> Shape:
        m = x.batch.meta
        return (x.batch.token_ids.shape[0], m.decode_only,
                next((f.name for f in self.features if f.marks(m)), None))

    def _build(self, x: StepInputs) -> jax.stages.Compiled:
        s = x.temperature.shape[0]
        spec = functools.partial(jax.tree.map, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding))
        allowed = (jax.ShapeDtypeStruct((s, self._mask_words), np.int32, sharding=self._fed.sharding),
                   np.bool_(False), spec(self._rules))
        counts = spec(self._counts)
        return self._step.lower(self._weights, self._cache_spec, self._fed_spec, counts, Packed.of(x),
                                allowed).compile()

    def _allowed(self, batch: Batch, s: int) -> tuple[Any, np.bool_, SlotRules]:
        """The step's grammar bitmask padded to its `s` rows, whether to apply it, and the
        slots' biases and bans (on the device already)."""
        mask = batch.inputs.token_mask
        if mask is None:
            return self._unmasked(s), np.bool_(False), self._rules
        if mask.shape[1] != self._mask_words:
            raise ValueError(f"a grammar bitmask of {mask.shape[1]} words a row; this model's "
                             f"vocabulary takes {self._mask_words}")
        padded = np.full((s, self._mask_words), -1, np.int32)
        padded[:len(mask)] = mask
        return padded, np.bool_(True), self._rules

    def _executable(self, x: StepInputs) -> jax.stages.Compiled:
        """The compiled step for `x`'s bucket, built ahead of time on its first use (or
        waited for, where a background warm-up is building it)."""
        shape = self._shape_of(x)
        exe, built = self._executables.get(shape, lambda: self._build(x))
        if built and self.warmed_up:
            log.warning("compiled step for new bucket (T, decode_only, cache feature)=%s "
                        "while serving", shape)
        return exe

    def _padding_inputs(self, t: int, decode_only: bool = False, feature: str | None = None) -> StepInputs:
        """An all-padding batch of the given bucket (in `feature`'s variant): writes only the
        scratch block."""
        z = np.zeros
        none = z(0, np.int32)
        s = self.buckets.seqs(t)
        batch = paged_batch(none, none, none, [], num_tokens=t, num_seqs=s,
                            max_blocks=self.buckets.max_blocks_per_seq, block_size=self.block_size,
                            scratch_block=self.scratch_block, decode_only=decode_only)
        meta = batch.meta
        for f in self.features:
            if f.name == feature:
                meta = f.padding_metadata(meta)
        return StepInputs(dataclasses.replace(batch, meta=meta), z(s, np.float32),
                          np.ones(s, np.float32), z(s, np.int32), z(s, np.uint32), z(s, np.int32),
                          np.full(t, -1, np.int32), z(t, np.int32), np.bool_(False), np.bool_(False),
                          z(s, np.int32), z(s, np.float32), z(s, np.float32), np.ones(s, np.float32),
                          np.full(t, NO_ROW, np.int32), z(s, bool), z(s, bool))

    # ------------------------------------------------------------------ execute
    def execute(self, batch: Batch) -> StepOutput:
        return self.dispatch(batch).result()

    def dispatch(self, batch: Batch) -> PendingStep:
        """Start the step; its outputs are read when the caller asks (`PendingStep.result`).
        Copies and swaps are issued first. A batch token that is `PLACEHOLDER` must be the
        token its sequence sampled in the previous dispatched step, read on the device."""
        refuse_unknown_steps(batch, self.features)
        if batch.inputs is not None:  # (a batch that only moves blocks may have none)
            self._hold(batch.inputs.delta)
        reads = [f.before_moves(batch, self.cache) for f in self.features]
        self._move_blocks(batch)
        for f, read in zip(self.features, reads):
            self.cache = f.after_moves(read, self.cache)
        if batch.num_seqs == 0:
            return _ready(StepOutput.empty())
        for f in self.features:
            groups = f.groups(batch)
            if groups is not None and len(groups) > 1:
                return _ready(_concat_outputs([self._compute(_sub_batch(batch, g)).result() for g in groups]))
        return self._compute(batch)

    def _hold(self, delta: BatchDelta) -> None:
        """Apply a delta to the held sequences, and start the device counts of new ones
        with penalties and the bias and ban rows of those with rules (both grow with the
        slots)."""
        self.held.apply(delta)
        if self.held.capacity > self._counts.num_slots:
            log.warning("%d sequences held: token counts grow to %d slots, steps compile again",
                        self.held.num_held, self.held.capacity)
            self._counts, self._rules = grown_rows((self._counts, self._rules), self.held.capacity)
            self._executables = Executables()  # built for the smaller counts
        pen = delta.added.penalties
        if pen is not None and pen.penalised.any():
            new = np.flatnonzero(pen.penalised)
            self._counts = reset_rows(self._counts, self.held.slots(delta.added.seq_ids[new].tolist()),
                                      [pen.prompts[i] for i in new])
        rules = delta.added.rules
        if rules is not None:
            new = np.flatnonzero(rules.biased | (rules.min_tokens > 0))
            self._rules = set_rows(self._rules, self.held.slots(delta.added.seq_ids[new].tolist()), rules, new)

    def _feed(self, batch: Batch) -> np.ndarray | None:
        """Per batch token, the previous step's row holding it (-1: the host has it)."""
        unknown = np.flatnonzero(batch.inputs.token_ids == PLACEHOLDER)
        if not len(unknown):
            return None
        seq_of = np.repeat(batch.seq_ids, batch.query_lens)[unknown]
        ids, rows = self._fed_rows
        at = np.searchsorted(ids, seq_of)
        if (at >= len(ids)).any() or (ids[np.minimum(at, len(ids) - 1)] != seq_of).any():
            raise RuntimeError("a token not yet read that the previous step did not sample")
        feed = np.full(batch.num_tokens, -1, np.int32)
        feed[unknown] = rows[at]
        return feed

    def _compute(self, batch: Batch) -> PendingStep:
        """The step's compute, its copies done, between each cache feature's copies before
        and after it (LayerKV: host layers read into staging blocks, new K/V written back)."""
        prepared = []
        for f in self.features:
            self.cache, step = f.before_compute(batch, self.cache)
            prepared.append((f, step))
        x = build_step_inputs(batch, self.buckets, self.block_size, self.held, self.mark_decode,
                              self._feed(batch), prepared)
        result, self.cache, self._fed, self._counts = self._executable(x)(
            self._weights, self.cache, self._fed, self._counts, Packed.of(x),
            self._allowed(batch, x.temperature.shape[0]))
        sampled = np.flatnonzero(batch.sample)
        order = np.argsort(batch.seq_ids[sampled], kind="stable")
        self._fed_rows = (batch.seq_ids[sampled][order], sampled[order])
        for f, step in prepared:
            f.after_compute(batch, self.cache, step)
        inputs = batch.inputs
        return PendingStep(result, batch.num_seqs, batch.num_tokens, inputs.logprobs,
                           inputs.next_token_ids is not None)

    def _move_blocks(self, batch: Batch) -> None:
        """Block copies, then swaps, before the step's compute, outs first: an in may reuse
        blocks an out freed."""
        if batch.block_copies:
            src, dst = np.asarray(batch.block_copies, np.int32).T
            self.cache = self.host_kv.copy(self.cache, src, dst)
        for move in batch.swap_out:
            self.host_kv.swap_out(self.cache, move)
        for move in batch.swap_in:
            self.cache = self.host_kv.swap_in(self.cache, move)
        for seq_id in batch.host_dropped:
            self.host_kv.drop(seq_id)

    @property
    def num_compiled(self) -> int:
        return len(self._executables)

