"""The one protocol a cache feature implements: a hook per stage of the loop, so that the
core checks and books whole blocks and asks each feature only where its requests differ,
and the runner builds whole-block paged steps and asks each feature only where its
sequences' tables, metadata, compiled variant or copies differ. Every hook has a default
that does nothing, so a feature writes only the stages it uses."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.engine.batch import Batch, BatchSection, BlockMove
from jserve.engine.live_requests import LiveRequests
from jserve.engine.plan import Plan
from jserve.engine.prefix_reuse import PrefixReuse

if TYPE_CHECKING:  # the runner's side only (the simulator never loads kernels)
    import jax

    from jserve.models.config import ModelConfig
    from jserve.models.paged import KVCache
    from jserve.pallas_kernels.attention_metadata import AttentionMetadata
    from jserve.pallas_kernels.backends import AttentionBackend

NO_ROWS = np.zeros(0, np.int64)


@dataclass(frozen=True)
class StateParts:
    """The engine state's parts a feature reads and changes."""

    live: LiveRequests
    blocks: BlockManager
    host_blocks: BlockManager | None
    reuse: PrefixReuse | None


@dataclass(frozen=True)
class SectionCheck:
    """What a feature's check found in a plan: what the core must count, and what the
    feature's own apply hooks book (`booking`).

    `discarded`: rows of running requests whose blocks go back before any take, recomputing
    from their first token in this plan. `whole_taken` / `whole_freed`: whole blocks its
    takes need and its releases give back, beyond the core's. `to_host`: host blocks its
    releases take (its own, or the preemptions it keeps). `own_allocations`: seq ids whose
    `Plan.allocate` the feature books itself (not as whole blocks). `claims`: seq ids the
    plan puts in the feature's own state, which no other feature may hold after it."""

    discarded: np.ndarray = field(default_factory=NO_ROWS.copy)
    whole_taken: int = 0
    whole_freed: int = 0
    to_host: int = 0
    own_allocations: frozenset[int] = frozenset()
    claims: tuple[int, ...] = ()
    booking: object = None


NOTHING = SectionCheck()


@dataclass(frozen=True)
class Runs:
    """The applied plan's runs as its batch lists them: seq ids, their rows in the live
    columns, the tokens each has cached and computes now."""

    seq_ids: np.ndarray  # [S] int64
    rows: np.ndarray  # [S] int64
    start: np.ndarray  # [S] int32
    query_lens: np.ndarray  # [S] int32


class CacheFeature:
    """A cache feature's hooks, in loop order. `name` keys its section in `Plan.features`
    (a plan naming a feature that is not registered is refused)."""

    name: str = ""

    # ------------------------------------------------------------------ snapshot
    def view_section(self, rows: np.ndarray) -> object | None:
        """Its part of the `SchedulerView` (`SchedulerView.features[name]`), or None; `rows`:
        the request table's rows the view's requests are, in order (its own columns' values
        for them, `RequestTable.add_column`)."""
        return None

    # ------------------------------------------------------------------ check
    def check(self, plan: Plan) -> SectionCheck:
        """Its plan section (and the rules it adds to the core's sections) against the
        state; `PlanError` for the first offender. Runs after the core's preemption and
        swap-in checks, before any block count."""
        return NOTHING

    def blocks_wanted(self, plan: Plan) -> int:
        """Whole device blocks its section takes, counted before the plan is checked (the
        prefix cache's eviction makes room for them)."""
        return 0

    def holds_after(self, seq_ids: list[int], plan: Plan) -> np.ndarray:
        """Which of `seq_ids` are in the feature's own state after `plan`."""
        return np.zeros(len(seq_ids), bool)

    def check_room(self, checked: SectionCheck, whole_left: int, to_host: int) -> None:
        """Refuse takes of its own beyond the room left: `whole_left` whole device blocks
        after every whole-block take, `to_host` host blocks the sections' releases take."""

    def block_tokens(self, rows: np.ndarray, plan: Plan | None = None) -> np.ndarray | None:
        """Tokens one block of each of `rows` holds (after `plan` when given), or None
        where the feature leaves every request at `block_size`."""
        return None

    # ------------------------------------------------------------------ apply, in the plan's order
    def drop(self, seq_id: int, row: int) -> None:
        """Give back what it holds of a request the core drops (preempted, or ended)."""

    def keep(self, checked: SectionCheck, seq_id: int, row: int, held: np.ndarray) -> bool:
        """Whether it keeps the KV of a request the plan preempts, whose `held` device
        blocks the core is freeing (then it sets the request's status; else the request
        waits to recompute from its first token)."""
        return False

    def release(self, checked: SectionCheck) -> None:
        """Its releases: after the plan's preemptions and evictions, before any take (so
        what it frees may serve the same plan's takes)."""

    def take_whole(self, checked: SectionCheck) -> None:
        """Its whole-block takes, with the swap-ins, before the plan's allocations."""

    def take_slots(self, checked: SectionCheck) -> None:
        """Its takes that are not whole blocks, after every whole-block take."""

    def after_runs(self, checked: SectionCheck, run_rows: np.ndarray) -> None:
        """Set what the core's booking of the plan's runs does not know (a status)."""

    def moves(self, checked: SectionCheck) -> tuple[Sequence[BlockMove], Sequence[BlockMove]]:
        """The whole requests its booking moves before the step's compute: device blocks to
        the host, and back."""
        return (), ()

    # ------------------------------------------------------------------ the runner's work
    def batch_section(self, checked: SectionCheck, runs: Runs, with_inputs: bool) -> BatchSection | None:
        """Its part of the applied plan's `Batch` (`Batch.features[name]`), or None where the
        step has none of its sequences or copies; `with_inputs`: the batch is a real runner's."""
        return None

    # ------------------------------------------------------------------ after the step
    def own_blocks(self) -> Collection[int]:
        """Seq ids whose blocks the feature keeps instead of the `BlockManager`."""
        return ()

    def check_invariants(self, prefix_cache: bool) -> None:
        """What must hold of its requests between steps."""


# ====================================================================== the runner's side
@dataclass(frozen=True)
class StepContext:
    """What a feature's runner side is built from: the model, the block layout, the step's
    largest bucket, the attention backend and the pages' sharding (None: one device)."""

    cfg: ModelConfig
    block_size: int
    num_blocks: int  # the engine's device blocks; a feature's own blocks come after them
    max_model_len: int
    max_tokens: int
    max_seqs: int
    attention: AttentionBackend
    kv_dtype: np.dtype
    pages_sharding: jax.sharding.Sharding | None = None


@dataclass(frozen=True)
class AttentionWrapper:
    """A feature's wrapper of the attention backend (`StepFeature.wrap_attention`): it
    handles the steps with the feature's metadata part and passes everything else (the
    backend's name, block copies and kernels) through to `inner`. Hashable, as the backend
    is: the model's jitted block takes it as a static argument."""

    inner: AttentionBackend

    def __getattr__(self, name: str) -> object:
        if name == "inner":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.inner, name)


class StepFeature:
    """A cache feature's runner side, in step order: the device blocks it adds, the attention
    it wraps, the compiled variant of steps holding its sequences, their tables and metadata,
    and the copies around the compute. `name` is the feature's (`CacheFeature.name`); the
    step key of a step with its sequences names it. Every hook has a default that does
    nothing."""

    name: str = ""
    compiled_ahead: bool = True  # whether warm-up compiles its variant of every step

    # ------------------------------------------------------------------ build
    def extra_blocks(self) -> int:
        """Device blocks it needs after the engine's own (at `StepContext.num_blocks`)."""
        return 0

    def table_width(self) -> int:
        """Block-table width its sequences need (0: the engine's)."""
        return 0

    def bind(self, scratch_block: int) -> None:
        """The cache is built: its scratch block (padding writes go there)."""

    def wrap_attention(self, attention: AttentionBackend) -> AttentionBackend:
        return attention

    def warm_up(self, cache: KVCache) -> KVCache:
        """Compile its own copies (writing only the scratch block)."""
        return cache

    # ------------------------------------------------------------------ a step
    def before_moves(self, batch: Batch, cache: KVCache) -> object:
        """Read what its moves copy, before the step's block copies and swaps (which may land
        where it reads); returns what `after_moves` writes."""
        return None

    def after_moves(self, reads: object, cache: KVCache) -> KVCache:
        return cache

    def groups(self, batch: Batch) -> list[np.ndarray] | None:
        """The batch's sequences in consecutive groups that run as steps of their own
        (None: one step)."""
        return None

    def before_compute(self, batch: Batch, cache: KVCache) -> tuple[KVCache, object]:
        """Copies before the compute; returns the cache and what this step's `tables`,
        `metadata` and `after_compute` read."""
        return cache, None

    def tables(self, batch: Batch, tables: np.ndarray) -> np.ndarray:
        """The step's block tables (its sequences' rows changed where its layout differs)."""
        return tables

    def metadata(self, batch: Batch, meta: AttentionMetadata,
                 table_of: Callable[[int], np.ndarray], step: object) -> AttentionMetadata:
        """The step's attention metadata with its sequences' part; `table_of(i)`: the whole
        block table the runner holds for the batch's sequence `i`."""
        return meta

    def padding_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """An all-padding step's metadata in its compiled variant (warm-up)."""
        return meta

    def marks(self, meta: AttentionMetadata) -> bool:
        """Whether `meta` has its part (the step is its compiled variant)."""
        return self.name in meta.parts

    def after_compute(self, batch: Batch, cache: KVCache, step: object) -> None:
        """Copies after the compute has been dispatched."""
