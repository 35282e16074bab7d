"""Serving metrics, defined once and used by every runner and benchmark: each request's TTFT,
TBT gaps, TPOT and E2E from its `RequestRecord` (one clock, wall or virtual), and a run's
statistics, SLO attainment and goodput (`summarize`). Every definition: docs/simulator.md,
Metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "TBT_SLO_MEASURES",
    "RequestRecord",
    "Summary",
    "assign_slos",
    "attach_slos",
    "e2e",
    "effective_throughput",
    "interpolated_crossing",
    "format_table",
    "max_tbt",
    "normalized_latency",
    "p99_tbt",
    "percentiles",
    "ratio",
    "summarize",
    "tail_excess_latency",
    "tbt_gaps",
    "tbt_slo_met",
    "tpot",
    "ttft",
    "ttft_slo_met",
    "vllm_report",
    "window_medians",
]


@dataclass(frozen=True)
class RequestRecord:
    """What the metrics need of one request, finished, aborted or still running."""

    request_id: str
    arrival_time: float
    first_token_time: float | None  # None if it never produced a token (aborted)
    finished_time: float | None
    token_times: tuple[float, ...]  # time of every output token, the first included
    prompt_len: int
    output_len: int
    num_preemptions: int = 0
    preempted_time: float = 0.0  # total seconds spent preempted
    ttft_slo: float | None = None  # overrides the global TTFT SLO of `summarize`
    tbt_slo: float | None = None  # overrides the global TBT SLO; judged on P99 TBT
    finished: bool = True  # completed normally; False for aborted or unfinished
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served

    def __post_init__(self) -> None:
        if not isinstance(self.token_times, tuple):
            object.__setattr__(self, "token_times", tuple(float(t) for t in self.token_times))
        if self.prompt_len < 0 or self.output_len < 0:
            raise ValueError(f"request {self.request_id!r}: negative prompt_len or output_len")
        if self.num_preemptions < 0 or self.preempted_time < 0:
            raise ValueError(f"request {self.request_id!r}: negative preemption count or time")


# ----------------------------------------------------------------------------- per request


def ttft(r: RequestRecord) -> float | None:
    """Time to first token, or None if the request produced no token."""
    return None if r.first_token_time is None else r.first_token_time - r.arrival_time


def tbt_gaps(r: RequestRecord) -> np.ndarray:
    """Every gap between consecutive output tokens (empty below two tokens)."""
    return np.diff(np.asarray(r.token_times, dtype=np.float64))


def p99_tbt(r: RequestRecord) -> float | None:
    """The request's own 99th-percentile gap between tokens, None without gaps."""
    return _pct(tbt_gaps(r), 99)


def max_tbt(r: RequestRecord) -> float | None:
    """The request's longest gap between tokens, None without gaps."""
    gaps = tbt_gaps(r)
    return float(gaps.max()) if gaps.size else None


def tpot(r: RequestRecord) -> float | None:
    """Time per output token after the first; None below two tokens or if unfinished."""
    if r.output_len < 2 or r.first_token_time is None or r.finished_time is None:
        return None
    return (r.finished_time - r.first_token_time) / (r.output_len - 1)


def e2e(r: RequestRecord) -> float | None:
    """Arrival to finish, None if the record has no finish time."""
    return None if r.finished_time is None else r.finished_time - r.arrival_time


def normalized_latency(r: RequestRecord) -> float | None:
    """E2E latency per output token, None without output tokens or finish time."""
    lat = e2e(r)
    return None if lat is None or r.output_len == 0 else lat / r.output_len


def ttft_slo_met(r: RequestRecord, slo: float | None = None) -> bool | None:
    """Whether the request met its TTFT SLO (its own, else `slo`); None if it has none.

    An aborted or unfinished request, or one without a first token, misses it.
    """
    bound = _slo_for(r.ttft_slo, slo)
    if bound is None:
        return None
    t = ttft(r)
    return bool(r.finished and t is not None and t <= bound)


# What the TBT SLO bounds: each request's P99 gap (Apt-Serve, CacheOpt), its TPOT (LayerKV)
# or its longest gap (CacheOpt's reproduction: every gap within the SLO).
TBT_SLO_MEASURES: dict[str, Callable[[RequestRecord], float | None]] = {
    "p99-tbt": p99_tbt, "tpot": tpot, "max-tbt": max_tbt}


def tbt_slo_met(r: RequestRecord, slo: float | None = None, on: str = "p99-tbt") -> bool | None:
    """Whether the request's P99 TBT (`on="p99-tbt"`), TPOT (`on="tpot"`) or longest gap
    (`on="max-tbt"`) met its TBT SLO (its own, else `slo`).

    None if it has no TBT SLO. A finished request with no gaps meets it vacuously;
    an aborted or unfinished request misses it.
    """
    measure = _measure(on)
    bound = _slo_for(r.tbt_slo, slo)
    if bound is None:
        return None
    if not r.finished:
        return False
    p = measure(r)
    return p is None or p <= bound


def _measure(on: str) -> Callable[[RequestRecord], float | None]:
    try:
        return TBT_SLO_MEASURES[on]
    except KeyError:
        raise ValueError(f"the TBT SLO is judged on one of {sorted(TBT_SLO_MEASURES)}, not {on!r}") from None


def _joint_slo_met(r: RequestRecord, ttft_slo: float | None, tbt_slo: float | None,
                   on: str) -> bool | None:
    verdicts = [v for v in (ttft_slo_met(r, ttft_slo), tbt_slo_met(r, tbt_slo, on)) if v is not None]
    return None if not verdicts else all(verdicts)


# ----------------------------------------------------------------------------- SLOs


def assign_slos(
    records_or_n: Sequence[RequestRecord] | int,
    ttft_mean: float,
    tbt_mean: float,
    scale: tuple[float, float] | None = (0.5, 2.5),
    seed: int | Sequence[int] | None = 0,
) -> list[tuple[float, float]]:
    """Per-request ``(ttft_slo, tbt_slo)`` pairs, one per record (or `n` of them).

    With ``scale=None`` every request gets the fixed pair ``(ttft_mean, tbt_mean)``.
    Otherwise each SLO is its mean times a factor drawn from U[lo, hi] (CacheOpt uses
    U[0.5, 2.5]); the TTFT and TBT factors of a request are drawn independently. The
    same `seed` (anything `np.random.default_rng` takes) gives the same pairs.
    """
    n = records_or_n if isinstance(records_or_n, int) else len(records_or_n)
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if ttft_mean <= 0 or tbt_mean <= 0:
        raise ValueError(f"SLO means must be > 0, got ttft_mean={ttft_mean}, tbt_mean={tbt_mean}")
    if scale is None:
        return [(float(ttft_mean), float(tbt_mean))] * n
    lo, hi = scale
    if not 0 < lo <= hi:
        raise ValueError(f"scale must satisfy 0 < lo <= hi, got {scale}")
    factors = np.random.default_rng(seed).uniform(lo, hi, size=(n, 2))
    return [(float(ttft_mean * a), float(tbt_mean * b)) for a, b in factors]


def attach_slos(
    records: Sequence[RequestRecord], slos: Sequence[tuple[float | None, float | None]]
) -> list[RequestRecord]:
    """Copies of `records` carrying the matching ``(ttft_slo, tbt_slo)`` pair."""
    if len(records) != len(slos):
        raise ValueError(f"{len(records)} records but {len(slos)} SLO pairs")
    return [dataclasses.replace(r, ttft_slo=a, tbt_slo=b) for r, (a, b) in zip(records, slos)]


# ----------------------------------------------------------------------------- run summary


@dataclass(frozen=True)
class Summary:
    """Metrics of one run. Times in seconds; None where there is nothing to measure."""

    num_requests: int
    num_finished: int
    makespan: float | None
    throughput_rps: float | None
    output_tokens_per_s: float | None
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p95: float | None
    ttft_p99: float | None
    tbt_mean: float | None  # over every gap of every finished request
    tbt_p50: float | None
    tbt_p90: float | None
    tbt_p99: float | None
    per_request_p99_tbt_mean: float | None
    per_request_p99_tbt_p99: float | None
    tpot_mean: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    e2e_mean: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    norm_latency_mean: float | None  # seconds per output token
    norm_latency_p99: float | None
    slo_attainment: float | None  # joint: every SLO the request has
    ttft_slo_attainment: float | None
    tbt_slo_attainment: float | None  # judged on `tbt_slo_on` of each request
    goodput_rps: float | None  # requests meeting the joint SLO per second of makespan
    num_preemptions: int
    preempted_time_total: float
    tbt_slo_on: str = "p99-tbt"  # what the TBT SLO bounds: a key of TBT_SLO_MEASURES

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(
    records: Iterable[RequestRecord],
    ttft_slo: float | None = None,
    tbt_slo: float | None = None,
    tbt_slo_on: str = "p99-tbt",
) -> Summary:
    """Summarize one run; per-request SLOs in `records` override `ttft_slo`/`tbt_slo`;
    `tbt_slo_on`: the TBT SLO bounds each request's "p99-tbt", "tpot" or "max-tbt"."""
    _measure(tbt_slo_on)
    records = list(records)
    done = [r for r in records if r.finished]

    ttfts = _values(ttft(r) for r in done)
    gaps = np.concatenate([tbt_gaps(r) for r in done]) if done else np.empty(0)
    p99s = _values(p99_tbt(r) for r in done)
    tpots = _values(tpot(r) for r in done)
    e2es = _values(e2e(r) for r in done)
    norms = _values(normalized_latency(r) for r in done)

    finishes = [r.finished_time for r in records if r.finished_time is not None]
    makespan = (
        max(finishes) - min(r.arrival_time for r in records) if records and finishes else None
    )

    def per_second(count: float | None) -> float | None:
        if count is None or makespan is None or makespan <= 0:
            return None
        return float(count / makespan)

    ttft_att = _attainment(ttft_slo_met(r, ttft_slo) for r in records)
    tbt_att = _attainment(tbt_slo_met(r, tbt_slo, tbt_slo_on) for r in records)
    joint = [_joint_slo_met(r, ttft_slo, tbt_slo, tbt_slo_on) for r in records]
    joint_att = _attainment(joint)
    good = None if joint_att is None else sum(v is True for v in joint)

    return Summary(
        num_requests=len(records),
        num_finished=len(done),
        makespan=None if makespan is None else float(makespan),
        throughput_rps=per_second(len(done)),
        output_tokens_per_s=per_second(sum(r.output_len for r in done)),
        ttft_mean=_mean(ttfts),
        ttft_p50=_pct(ttfts, 50),
        ttft_p90=_pct(ttfts, 90),
        ttft_p95=_pct(ttfts, 95),
        ttft_p99=_pct(ttfts, 99),
        tbt_mean=_mean(gaps),
        tbt_p50=_pct(gaps, 50),
        tbt_p90=_pct(gaps, 90),
        tbt_p99=_pct(gaps, 99),
        per_request_p99_tbt_mean=_mean(p99s),
        per_request_p99_tbt_p99=_pct(p99s, 99),
        tpot_mean=_mean(tpots),
        tpot_p50=_pct(tpots, 50),
        tpot_p99=_pct(tpots, 99),
        e2e_mean=_mean(e2es),
        e2e_p50=_pct(e2es, 50),
        e2e_p99=_pct(e2es, 99),
        norm_latency_mean=_mean(norms),
        norm_latency_p99=_pct(norms, 99),
        slo_attainment=joint_att,
        ttft_slo_attainment=ttft_att,
        tbt_slo_attainment=tbt_att,
        goodput_rps=per_second(good),
        num_preemptions=int(sum(r.num_preemptions for r in records)),
        preempted_time_total=float(sum(r.preempted_time for r in records)),
        tbt_slo_on=tbt_slo_on,
    )


# ----------------------------------------------------------------------------- across runs


def effective_throughput(
    rates: Sequence[float], attainments: Sequence[float | None], threshold: float = 0.9
) -> float | None:
    """The highest request rate whose SLO attainment is >= `threshold`.

    Stricter than "any passing rate": the rate *and every lower measured rate* must
    pass, so a lucky pass above a failing rate does not count (attainment need not be
    monotonic in a noisy sweep). A None or NaN attainment fails. Returns None if the
    lowest rate already fails or there are no rates.
    """
    if len(rates) != len(attainments):
        raise ValueError(f"{len(rates)} rates but {len(attainments)} attainments")
    best: float | None = None
    for rate, att in sorted(zip(rates, attainments), key=lambda p: p[0]):
        if att is None or not att >= threshold:
            break
        best = float(rate)
    return best


def interpolated_crossing(rates: Sequence[float], values: Sequence[float], level: float,
                          rising: bool = False) -> float:
    """The rate where `values` (measured at increasing `rates`) first pass `level`,
    interpolated linearly between the two rates around it: falling through it (an SLO
    attainment) or, with `rising`, rising through it (violations). 0 if the lowest rate is
    past it already, infinity if no measured rate reaches it. Unlike
    `effective_throughput`, not quantised to the grid."""
    sign = 1.0 if rising else -1.0
    if not len(values) or sign * (values[0] - level) >= 0:
        return 0.0
    for (r0, v0), (r1, v1) in zip(zip(rates, values), zip(rates[1:], values[1:])):
        if sign * (v0 - level) < 0 <= sign * (v1 - level):
            return r0 + (r1 - r0) * (level - v0) / (v1 - v0)
    return math.inf


def ratio(a: float | None, b: float | None) -> float:
    """`a` over `b`, NaN where either is missing, not positive or infinite (a rate off a
    sweep's grid): a comparison of two runs' figures that says "no figure" rather than
    dividing by zero or reporting an infinite gain."""
    if a is None or b is None or not (0 < a < math.inf and 0 < b < math.inf):
        return math.nan
    return a / b


def tail_excess_latency(ttfts: Iterable[float], threshold: float) -> float:
    """Tail Excess Latency: ``sum(max(ttft - threshold, 0))`` over requests (T-LRU)."""
    arr = np.asarray(list(ttfts), dtype=np.float64)
    return float(np.maximum(arr - threshold, 0.0).sum()) if arr.size else 0.0



def window_medians(records: Sequence[RequestRecord], metric: Callable[[RequestRecord], float | None],
                   windows: int) -> list[float | None]:
    """The median of `metric` over each of `windows` equal slices of the requests taken in
    arrival order (None for a slice without a value): flat medians say a run is in steady
    state at its load, medians that keep rising say its queue grows for the whole run."""
    if windows < 1:
        raise ValueError(f"windows must be >= 1, got {windows}")
    ordered = sorted(records, key=lambda r: r.arrival_time)
    edges = np.linspace(0, len(ordered), windows + 1).astype(int)
    return [_pct(_values(metric(r) for r in ordered[a:b]), 50) for a, b in itertools.pairwise(edges)]


def percentiles(values: Iterable[float], qs: Iterable[float]) -> list[float | None]:
    """The `qs` percentiles of any series (linear, as every statistic here), None for an
    empty one: the same rule for figures not read from `RequestRecord`s, such as a
    published run's latencies or a cache model's uncached tokens."""
    a = np.asarray(list(values), dtype=np.float64)
    return [_pct(a, q) for q in qs]


# ----------------------------------------------------------------------------- display


VLLM_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
VLLM_STATS = ("mean", "median", "p90", "p99", "std", "max")


def vllm_report(records: Sequence[RequestRecord], summary: Summary) -> dict[str, float | int | None]:
    """The figures `vllm bench serve` writes, under its names and units, so a run can sit
    beside vLLM's without translating: `{stat}_{metric}_ms` for TTFT, TPOT, ITL (every gap
    between tokens, pooled: our TBT) and E2EL (our E2E) over finished requests, `std` the
    population deviation (numpy's, as vLLM's); throughputs per second of makespan; the
    goodput None without an SLO."""
    done = [r for r in records if r.finished]
    series = {
        "ttft": _values(ttft(r) for r in done),
        "tpot": _values(tpot(r) for r in done),
        "itl": np.concatenate([tbt_gaps(r) for r in done]) if done else np.empty(0),
        "e2el": _values(e2e(r) for r in done),
    }
    stats = {"mean": np.mean, "median": np.median, "p90": lambda a: np.percentile(a, 90),
             "p99": lambda a: np.percentile(a, 99), "std": np.std, "max": np.max}
    out: dict[str, float | int | None] = {
        "duration": summary.makespan,
        "completed": summary.num_finished,
        "total_input_tokens": int(sum(r.prompt_len for r in done)),
        "total_output_tokens": int(sum(r.output_len for r in done)),
        "request_throughput": summary.throughput_rps,
        "output_throughput": summary.output_tokens_per_s,
        "total_token_throughput": None if not summary.makespan else
        float(sum(r.prompt_len + r.output_len for r in done) / summary.makespan),
        "request_goodput": summary.goodput_rps,
    }
    for metric, _ in VLLM_METRICS:
        a = series[metric]
        for stat in VLLM_STATS:
            out[f"{stat}_{metric}_ms"] = float(stats[stat](a) * 1e3) if a.size else None
    return out


def format_table(summary: Summary, report: dict[str, float | int | None]) -> str:
    """A compact human table: `report`'s (`vllm_report`) latencies in milliseconds under
    vLLM's names, then counts, throughput, SLOs and preemptions."""

    def ms(x: float | int | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    def num(x: float | None, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:.1f}%"

    s = summary
    lines = [f"{'latency (ms)':<13}" + "".join(f"{stat:>9}" for stat in VLLM_STATS)]
    lines += [f"{name:<13}" + "".join(f"{ms(report[f'{stat}_{metric}_ms']):>9}" for stat in VLLM_STATS)
              for metric, name in VLLM_METRICS]
    if s.slo_attainment is None:
        slos = "no SLO given (--ttft-slo / --tbt-slo), so no attainment or goodput"
    else:
        slos = (f"joint {pct(s.slo_attainment)}, TTFT {pct(s.ttft_slo_attainment)}, "
                f"TBT ({s.tbt_slo_on}) {pct(s.tbt_slo_attainment)}, goodput {num(s.goodput_rps)} req/s")
    lines += [
        f"requests      {s.num_finished}/{s.num_requests} finished, "
        f"duration {num(s.makespan)} s",
        f"throughput    {num(s.throughput_rps)} req/s, {num(s.output_tokens_per_s, '.1f')} output tok/s",
        f"SLO attained  {slos}",
        f"preemptions   {s.num_preemptions} ({s.preempted_time_total:.2f} s preempted)",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- helpers


def _slo_for(own: float | None, default: float | None) -> float | None:
    return default if own is None else own


def _values(xs: Iterable[float | None]) -> np.ndarray:
    return np.asarray([x for x in xs if x is not None], dtype=np.float64)


def _mean(a: np.ndarray) -> float | None:
    return float(a.mean()) if a.size else None


def _pct(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q, method="linear")) if a.size else None


def _attainment(verdicts: Iterable[bool | None]) -> float | None:
    judged = [v for v in verdicts if v is not None]
    return sum(judged) / len(judged) if judged else None


@dataclass(frozen=True)
class EngineTotals:
    """Engine-wide counts of one run (the HTTP backend reads them from `/metrics`)."""

    num_steps: int
    num_preemptions: int
    num_blocks: int
    num_swaps: int | None = None  # preemptions by swap; None where not reported (HTTP)
