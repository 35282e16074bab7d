"""The work of one iteration as runners see it, and what they hand back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class SequenceSettings:
    """Sampling settings of sequences a runner meets for the first time, by seq id: a
    sequence keeps them for its life, so they are sent once, not every step."""

    seq_ids: np.ndarray  # [N] int64
    temperature: np.ndarray  # [N] float32
    top_p: np.ndarray  # [N] float32
    top_k: np.ndarray  # [N] int32, 0 = off
    seeds: np.ndarray  # [N] uint32
    penalties: PenaltySettings | None = None  # None: no new sequence has a penalty
    rules: TokenRuleSettings | None = None  # None: no new sequence has a bias, ban or min_tokens


@dataclass(frozen=True)
class PenaltySettings:
    """The penalties of `SequenceSettings`' sequences (vLLM's), and what the runner's
    device counts of their tokens start from: where outputs begin, and the prompt's tokens
    of those with a repetition penalty (it reads the prompt too; others' are empty)."""

    presence: np.ndarray  # [N] float32, 0 = off
    frequency: np.ndarray  # [N] float32, 0 = off
    repetition: np.ndarray  # [N] float32, 1 = off
    prompt_len: np.ndarray  # [N] int32
    prompts: tuple[np.ndarray, ...]  # [N] int32 arrays

    @property
    def penalised(self) -> np.ndarray:
        """[N] bool: which sequences have some penalty."""
        return (self.presence != 0) | (self.frequency != 0) | (self.repetition != 1)


@dataclass(frozen=True)
class TokenRuleSettings:
    """Logit changes of `SequenceSettings`' sequences besides penalties (vLLM's logit_bias,
    bad_words and min_tokens): per sequence, the ids and values added to its logits (a
    banned word's -inf), and the ids held back while it has fewer than `min_tokens` output
    tokens."""

    bias_ids: tuple[np.ndarray, ...]  # [N] int32 arrays
    bias: tuple[np.ndarray, ...]  # [N] float32 arrays
    min_tokens: np.ndarray  # [N] int32, 0 = off
    stop_ids: tuple[np.ndarray, ...]  # [N] int32 arrays

    @property
    def biased(self) -> np.ndarray:
        """[N] bool: which sequences have a bias or a ban."""
        return np.array([len(b) > 0 for b in self.bias_ids], bool)


@dataclass(frozen=True)
class BatchDelta:
    """What changed in the sequences a real runner keeps between steps (its persistent
    batch, `jserve.runners.input_batch`) since the previous batch with inputs: sequences
    new to it with their settings, block tables changed from some index on (appended
    blocks, or a table freed by a preemption: empty from 0), and sequences that ended.
    A decode step of sequences the runner already holds sends one block at most."""

    added: SequenceSettings
    tables: dict[int, tuple[int, np.ndarray]]  # seq id -> (first changed index, table from it)
    ended: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (len(self.added.seq_ids) or self.tables or self.ended)

    @classmethod
    def of_sequences(cls, seq_ids: Sequence[int], tables: Sequence[np.ndarray], *,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     seed: int | np.ndarray = 0) -> BatchDelta:
        """Sequences and their whole tables from scratch, with the same settings (or one
        seed each): a batch made by hand (profiling, benchmarks), not by an engine."""
        n = len(seq_ids)

        def each(value: float | np.ndarray, dtype: type) -> np.ndarray:
            return np.broadcast_to(np.asarray(value, dtype), (n,)).copy()

        return cls(SequenceSettings(np.asarray(seq_ids, np.int64), each(temperature, np.float32),
                                    each(top_p, np.float32), each(top_k, np.int32), each(seed, np.uint32)),
                   {int(s): (0, np.asarray(t, np.int32)) for s, t in zip(seq_ids, tables)})


@dataclass(frozen=True)
class BatchInputs:
    """What a real runner needs beyond the shape of the work: this step's token ids and
    what changed in the sequences it holds (`delta`). The simulator never asks for them,
    which keeps its steps cheap."""

    token_ids: np.ndarray  # [T] int32, flat
    output_index: np.ndarray  # [S] int32: index of the token being sampled (for the RNG)
    delta: BatchDelta
    # Only when a request asks (`SamplingParams.logprobs` / `prompt_logprobs`): the
    # runner then also returns the top log-probabilities of sampled tokens, and with
    # `next_token_ids` ([T] int32, the token after each flat position; 0 past the known
    # ones) those of every position.
    logprobs: bool = False
    next_token_ids: np.ndarray | None = None
    # Only while a request decodes under a grammar (`SamplingParams.grammar`): per sequence,
    # the tokens it may sample, as llguidance's bitmask ([S, words] int32, bit t % 32 of
    # word t // 32 allows token t; a row of -1 allows all).
    token_mask: np.ndarray | None = None


@dataclass(frozen=True)
class BlockMove:
    """A request's KV moving between device and host: its device blocks, in table order
    (where a swap-out reads from, or where a swap-in writes to). A prefix-cache block's
    demotion or load has a negative key (`jserve.cache.prefix.host_move_key`)."""

    seq_id: int
    device_blocks: np.ndarray  # int32


class BatchSection(Protocol):
    """A cache feature's part of a `Batch` (`Batch.features[name]`, e.g.
    `jserve.cache_features.layer_offload.batch.LayerBatch`): what its sequences and copies
    ask of a runner, and what they add to the step's cost."""

    @property
    def moves_blocks(self) -> bool:
        """Whether it moves blocks (before the compute, or the step's own host traffic)."""
        ...

    def sliced(self, lo: int, hi: int) -> BatchSection | None:
        """Its part for the batch's sequences `lo:hi` once the step's copies are done (a
        runner running the batch in groups); None: none of them is its."""
        ...

    def shape_terms(self, batch: Batch, bytes_per_block: int) -> Mapping[str, object]:
        """What it adds to the step's `jserve.runners.cost_model.StepShape`, by field."""
        ...


@dataclass(frozen=True)
class Batch:
    """Scheduled sequences in plan order; sequence `i` computes `query_lens[i]` tokens
    starting at position `start[i]`, all laid on one flat token axis.

    `sample[i]` is true when the chunk reaches the sequence's last known token, so the step
    yields its next token; an intermediate prefill chunk samples nothing.
    """

    seq_ids: np.ndarray  # [S] int64
    start: np.ndarray  # [S] int32: tokens already cached
    query_lens: np.ndarray  # [S] int32
    sample: np.ndarray  # [S] bool
    inputs: BatchInputs | None = None  # None unless the runner asked for them
    # Device block copies (src, dst), done before anything else of the step: a forked
    # sequence's copy of the block it writes next (`jserve.engine.fork`).
    block_copies: tuple[tuple[int, int], ...] = ()
    # Done before the step's compute, outs first (an in may reuse blocks an out freed).
    swap_out: tuple[BlockMove, ...] = ()
    swap_in: tuple[BlockMove, ...] = ()
    host_dropped: tuple[int, ...] = ()  # seq ids that ended while swapped out
    # Each cache feature's part, by feature name, where the step has its sequences or
    # copies (`jserve.cache_features`; the runner's side of a feature reads its own).
    features: Mapping[str, BatchSection] = field(default_factory=dict)

    @property
    def moves_blocks(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.host_dropped or self.block_copies
                    or any(f.moves_blocks for f in self.features.values()))

    @property
    def updates_runner(self) -> bool:
        """Block moves, or changes to the sequences a runner keeps, that it must see even
        when nothing runs."""
        return self.moves_blocks or (self.inputs is not None and not self.inputs.delta.is_empty)

    @property
    def num_swapped_out(self) -> int:
        """Requests whose KV this step moves to the host (not prefix-cache blocks)."""
        return sum(m.seq_id >= 0 for m in self.swap_out)

    @property
    def num_swapped_blocks(self) -> int:
        return sum(len(m.device_blocks) for m in self.swap_out + self.swap_in)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    @property
    def context_lens(self) -> np.ndarray:
        return self.start + self.query_lens

    @property
    def num_decode_tokens(self) -> int:
        return int((self.query_lens == 1).sum())


@dataclass(frozen=True)
class TopLogprobs:
    """The `MAX_LOGPROBS` most likely next tokens of some positions, most likely first."""

    token_ids: np.ndarray  # [N, K] int32
    logprobs: np.ndarray  # [N, K] float32


@dataclass(frozen=True)
class StepOutput:
    """Next token (and its log-probability) per scheduled sequence; unused where not sampled.

    `ended`: sequences whose sampled token ends them, as an end-of-sequence token would,
    for a runner that replays recorded generation lengths (a benchmark replaying a trace
    ends each request where the trace's did, without the length reaching the policy as a
    `max_tokens`); None: the tokens alone decide."""

    next_tokens: np.ndarray  # [S] int32
    logprobs: np.ndarray  # [S] float32
    ended: np.ndarray | None = None  # [S] bool
    top_logprobs: TopLogprobs | None = None  # of the sampled positions, if the batch asked
    # of every flat position, if the batch asked for prompt log-probabilities: the
    # next token's log-probability [T] and the top ones
    position_logprobs: tuple[np.ndarray, TopLogprobs] | None = None

    @classmethod
    def empty(cls) -> StepOutput:
        return cls(np.zeros(0, np.int32), np.zeros(0, np.float32))


@dataclass(frozen=True)
class RepeatedSteps:
    """What a runner hands back for repeated decode steps of one batch (`Plan.repeat`):
    step `j` ended at `end_times[j]` and gave sequence `i` the token `next_tokens[j, i]`.
    `ended`: as `StepOutput.ended`, for the last step (a runner that ends sequences stops
    the repeat at the first step that ends one)."""

    end_times: tuple[float, ...]
    next_tokens: np.ndarray  # [steps, S] int32
    logprobs: np.ndarray  # [steps, S] float32
    ended: np.ndarray | None = None  # [S] bool

    @property
    def num_steps(self) -> int:
        return len(self.end_times)
