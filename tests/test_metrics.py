"""Tests for jserve.benchmarking.metrics: small hand-computed traces for every metric."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from jserve.benchmarking.metrics import (
    RequestRecord,
    Summary,
    assign_slos,
    attach_slos,
    e2e,
    effective_throughput,
    format_table,
    interpolated_crossing,
    max_tbt,
    vllm_report,
    normalized_latency,
    p99_tbt,
    percentiles,
    ratio,
    summarize,
    tail_excess_latency,
    tbt_gaps,
    tbt_slo_met,
    tpot,
    ttft,
    ttft_slo_met,
    window_medians,
)


def rec(
    rid: str,
    arrival: float,
    token_times: tuple[float, ...],
    finished_time: float | None = None,
    **kw: object,
) -> RequestRecord:
    """A record whose first token, finish (by default) and output length follow from `token_times`."""
    if finished_time is None and token_times:
        finished_time = token_times[-1]
    return RequestRecord(
        request_id=rid,
        arrival_time=arrival,
        first_token_time=token_times[0] if token_times else None,
        finished_time=finished_time,
        token_times=token_times,
        prompt_len=kw.pop("prompt_len", 10),  # type: ignore[arg-type]
        output_len=kw.pop("output_len", len(token_times)),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


# A: TTFT 1.0, gaps [0.5, 1.0, 0.5], E2E 3.0, 4 tokens.
A = rec("a", 0.0, (1.0, 1.5, 2.5, 3.0), num_preemptions=1, preempted_time=0.3)
# B: TTFT 0.5, gaps [0.5], E2E 1.0, 2 tokens.
B = rec("b", 1.0, (1.5, 2.0))
# C: aborted at t=4 before its first token.
C = RequestRecord("c", 2.0, None, 4.0, (), prompt_len=7, output_len=0,
                  num_preemptions=2, preempted_time=0.7, finished=False)


# ----------------------------------------------------------------------------- per request


def test_per_request_values() -> None:
    assert ttft(A) == pytest.approx(1.0)
    np.testing.assert_allclose(tbt_gaps(A), [0.5, 1.0, 0.5])
    # linear percentile of sorted [0.5, 0.5, 1.0] at index 0.99 * 2 = 1.98
    assert p99_tbt(A) == pytest.approx(0.5 + 0.98 * 0.5)
    assert tpot(A) == pytest.approx(2.0 / 3.0)
    assert e2e(A) == pytest.approx(3.0)
    assert normalized_latency(A) == pytest.approx(0.75)

    assert ttft(B) == pytest.approx(0.5)
    assert p99_tbt(B) == pytest.approx(0.5)
    assert tpot(B) == pytest.approx(0.5)
    assert normalized_latency(B) == pytest.approx(0.5)


def test_tpot_uses_finish_time_not_last_token() -> None:
    r = rec("x", 0.0, (1.0, 2.0, 3.0), finished_time=5.0)
    assert tpot(r) == pytest.approx((5.0 - 1.0) / 2)


def test_single_token_and_no_token_requests() -> None:
    one = rec("one", 0.0, (0.2,))
    assert tbt_gaps(one).size == 0
    assert p99_tbt(one) is None
    assert tpot(one) is None
    assert normalized_latency(one) == pytest.approx(0.2)
    assert ttft(C) is None and p99_tbt(C) is None and tpot(C) is None
    assert normalized_latency(C) is None  # no output tokens


def test_token_times_list_is_frozen_to_tuple() -> None:
    r = RequestRecord("x", 0.0, 1.0, 2.0, [1.0, 2.0], 3, 2)  # type: ignore[arg-type]
    assert r.token_times == (1.0, 2.0)


def test_record_validation() -> None:
    with pytest.raises(ValueError):
        RequestRecord("x", 0.0, None, None, (), prompt_len=-1, output_len=0)
    with pytest.raises(ValueError):
        RequestRecord("x", 0.0, None, None, (), 1, 0, preempted_time=-1.0)


# ----------------------------------------------------------------------------- SLO verdicts


def test_slo_verdicts_per_request_override_global() -> None:
    assert ttft_slo_met(A) is None  # no SLO anywhere
    assert ttft_slo_met(A, 0.8) is False
    assert ttft_slo_met(A, 1.0) is True  # boundary passes
    overridden = attach_slos([A], [(1.5, 0.2)])[0]
    assert ttft_slo_met(overridden, 0.8) is True  # own 1.5 beats global 0.8
    assert tbt_slo_met(overridden, 5.0) is False  # own 0.2 < P99 0.99
    assert tbt_slo_met(A, 1.0) is True  # judged on P99 0.99, not the max gap 1.0
    assert tbt_slo_met(A, 0.98) is False


def test_slo_verdicts_aborted_and_single_token() -> None:
    assert ttft_slo_met(C, 100.0) is False
    assert tbt_slo_met(C, 100.0) is False
    one = rec("one", 0.0, (0.2,))
    assert tbt_slo_met(one, 0.001) is True  # no gaps: vacuously met
    # aborted after producing tokens still misses
    aborted = rec("ab", 0.0, (0.1, 0.2), finished=False)
    assert ttft_slo_met(aborted, 1.0) is False


# ----------------------------------------------------------------------------- summary


def test_summarize_hand_computed() -> None:
    s = summarize([A, B, C], ttft_slo=0.8, tbt_slo=0.6)
    assert s.num_requests == 3 and s.num_finished == 2
    assert s.makespan == pytest.approx(4.0)  # arrival 0 to C's abort at 4
    assert s.throughput_rps == pytest.approx(2 / 4)
    assert s.output_tokens_per_s == pytest.approx(6 / 4)
    # TTFT over finished [1.0, 0.5]
    assert s.ttft_mean == pytest.approx(0.75)
    assert s.ttft_p50 == pytest.approx(0.75)
    assert s.ttft_p90 == pytest.approx(0.95)
    assert s.ttft_p95 == pytest.approx(0.975)
    assert s.ttft_p99 == pytest.approx(0.995)
    # all gaps [0.5, 1.0, 0.5, 0.5]
    assert s.tbt_mean == pytest.approx(0.625)
    assert s.tbt_p50 == pytest.approx(0.5)
    assert s.tbt_p99 == pytest.approx(0.5 + 0.97 * 0.5)
    assert s.per_request_p99_tbt_mean == pytest.approx((0.99 + 0.5) / 2)
    assert s.tpot_mean == pytest.approx((2 / 3 + 0.5) / 2)
    assert s.e2e_mean == pytest.approx(2.0)
    assert s.e2e_p99 == pytest.approx(1.0 + 0.99 * 2.0)
    assert s.norm_latency_mean == pytest.approx((0.75 + 0.5) / 2)
    # only B meets both; C (aborted) misses both
    assert s.ttft_slo_attainment == pytest.approx(1 / 3)
    assert s.tbt_slo_attainment == pytest.approx(1 / 3)
    assert s.slo_attainment == pytest.approx(1 / 3)
    assert s.goodput_rps == pytest.approx(1 / 4)
    assert s.num_preemptions == 3
    assert s.preempted_time_total == pytest.approx(1.0)


def test_joint_is_stricter_than_separate() -> None:
    # A meets TTFT (1.0 <= 1.0) but not TBT (P99 0.99 > 0.6);
    # D misses TTFT (2.0) but meets TBT (P99 0.1).
    d = rec("d", 0.0, (2.0, 2.1))
    s = summarize([A, d], ttft_slo=1.0, tbt_slo=0.6)
    assert s.ttft_slo_attainment == pytest.approx(0.5)
    assert s.tbt_slo_attainment == pytest.approx(0.5)
    assert s.slo_attainment == 0.0
    assert s.goodput_rps == 0.0


def test_per_request_slos_override_global_in_summary() -> None:
    a, b = attach_slos([A, B], [(1.5, 1.0), (None, None)])
    s = summarize([a, b], ttft_slo=0.4, tbt_slo=0.4)
    # A judged on its own (1.5, 1.0): met; B on the global (0.4, 0.4): both missed
    assert s.ttft_slo_attainment == pytest.approx(0.5)
    assert s.tbt_slo_attainment == pytest.approx(0.5)
    assert s.slo_attainment == pytest.approx(0.5)
    assert s.goodput_rps == pytest.approx(1 / 3.0)  # makespan 0 -> 3


def test_attainment_counts_only_requests_with_an_slo() -> None:
    a = attach_slos([A], [(1.5, None)])[0]
    s = summarize([a, B])
    assert s.ttft_slo_attainment == 1.0  # only A has a TTFT SLO
    assert s.tbt_slo_attainment is None
    assert s.slo_attainment == 1.0  # joint judges the SLOs each request has


def test_only_ttft_slo_joint_equals_ttft() -> None:
    s = summarize([A, B, C], ttft_slo=0.8)
    assert s.tbt_slo_attainment is None
    assert s.ttft_slo_attainment == pytest.approx(1 / 3)
    assert s.slo_attainment == pytest.approx(1 / 3)


def test_no_slo_gives_none_not_one() -> None:
    s = summarize([A, B])
    assert s.slo_attainment is None
    assert s.ttft_slo_attainment is None
    assert s.tbt_slo_attainment is None
    assert s.goodput_rps is None


def test_empty_records() -> None:
    s = summarize([], ttft_slo=1.0, tbt_slo=1.0)
    assert s.num_requests == 0 and s.num_finished == 0
    assert s.makespan is None and s.throughput_rps is None
    assert s.ttft_mean is None and s.tbt_p99 is None and s.e2e_mean is None
    assert s.slo_attainment is None and s.goodput_rps is None
    assert s.num_preemptions == 0 and s.preempted_time_total == 0.0
    assert isinstance(format_table(s, vllm_report([], s)), str)


def test_all_aborted() -> None:
    never = RequestRecord("n", 0.0, None, None, (), 5, 0, finished=False)
    s = summarize([C, never], ttft_slo=1.0, tbt_slo=1.0)
    assert s.num_requests == 2 and s.num_finished == 0
    assert s.ttft_mean is None and s.tbt_mean is None and s.tpot_mean is None
    assert s.slo_attainment == 0.0 and s.ttft_slo_attainment == 0.0
    assert s.makespan == pytest.approx(4.0)  # C's abort time bounds it
    assert s.throughput_rps == 0.0 and s.goodput_rps == 0.0


def test_zero_makespan_gives_no_rates() -> None:
    r = RequestRecord("z", 1.0, 1.0, 1.0, (1.0,), 1, 1)
    s = summarize([r], ttft_slo=1.0)
    assert s.makespan == 0.0
    assert s.throughput_rps is None and s.goodput_rps is None
    assert s.slo_attainment == 1.0


def test_to_dict_is_json_and_complete() -> None:
    s = summarize([A, B, C], ttft_slo=0.8, tbt_slo=0.6)
    d = s.to_dict()
    assert set(d) == {f.name for f in Summary.__dataclass_fields__.values()}
    assert json.loads(json.dumps(d)) == d
    assert all(type(v) in (int, float, type(None)) for k, v in d.items() if k != "tbt_slo_on")
    assert d["tbt_slo_on"] == "p99-tbt"


def test_format_table_shows_milliseconds() -> None:
    s = summarize([A, B, C], ttft_slo=0.8, tbt_slo=0.6)
    text = format_table(s, vllm_report([A, B, C], s))
    assert "750.0" in text  # TTFT mean 0.75 s
    assert "2/3 finished" in text
    assert "33.3%" in text
    for name in ("TTFT", "TPOT", "ITL", "E2EL", "median", "p90", "std", "max"):
        assert name in text
    plain = summarize([A, B])
    assert "no SLO given" in format_table(plain, vllm_report([A, B], plain))


def test_vllm_report_uses_vllms_names_in_milliseconds() -> None:
    """TTFTs 1.0 and 0.5 s; ITL pools the gaps 0.5, 1.0, 0.5 and 0.5 s; aborted C counts nowhere."""
    r = vllm_report([A, B, C], summarize([A, B, C]))
    assert r["mean_ttft_ms"] == pytest.approx(750.0) and r["median_ttft_ms"] == pytest.approx(750.0)
    assert r["std_ttft_ms"] == pytest.approx(250.0) and r["max_ttft_ms"] == pytest.approx(1000.0)
    assert r["p99_ttft_ms"] == pytest.approx(995.0) and r["p90_ttft_ms"] == pytest.approx(950.0)
    assert r["mean_itl_ms"] == pytest.approx(625.0) and r["max_itl_ms"] == pytest.approx(1000.0)
    assert r["mean_e2el_ms"] == pytest.approx(2000.0)
    assert r["completed"] == 2 and r["request_goodput"] is None
    assert {f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99", "std", "max")
            for m in ("ttft", "tpot", "itl", "e2el")} <= set(r)


# ----------------------------------------------------------------------------- SLO assignment


def test_assign_slos_fixed() -> None:
    assert assign_slos(3, 0.5, 0.1, scale=None) == [(0.5, 0.1)] * 3
    assert assign_slos([A, B], 0.5, 0.1, scale=None) == [(0.5, 0.1)] * 2
    assert assign_slos(0, 0.5, 0.1) == []


def test_assign_slos_scaled_bounds_and_determinism() -> None:
    pairs = assign_slos(2000, 2.0, 0.1, scale=(0.5, 2.5), seed=7)
    arr = np.array(pairs)
    assert arr[:, 0].min() >= 1.0 and arr[:, 0].max() <= 5.0
    assert arr[:, 1].min() >= 0.05 and arr[:, 1].max() <= 0.25
    assert arr[:, 0].mean() == pytest.approx(3.0, rel=0.05)  # 2.0 * E[U(0.5, 2.5)]
    assert arr[:, 1].mean() == pytest.approx(0.15, rel=0.05)
    assert pairs == assign_slos(2000, 2.0, 0.1, scale=(0.5, 2.5), seed=7)
    assert pairs != assign_slos(2000, 2.0, 0.1, scale=(0.5, 2.5), seed=8)
    # TTFT and TBT factors are independent draws
    assert abs(np.corrcoef(arr[:, 0], arr[:, 1])[0, 1]) < 0.1


def test_assign_slos_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        assign_slos(3, 1.0, 1.0, scale=(0.0, 2.0))
    with pytest.raises(ValueError):
        assign_slos(3, 1.0, 1.0, scale=(2.0, 1.0))
    with pytest.raises(ValueError):
        assign_slos(-1, 1.0, 1.0)
    with pytest.raises(ValueError):
        assign_slos(3, 0.0, 1.0)
    with pytest.raises(ValueError):
        attach_slos([A], [])


def test_attach_then_summarize_with_assigned_slos() -> None:
    recs = attach_slos([A, B], assign_slos([A, B], 0.5, 0.5, scale=None))
    assert [(r.ttft_slo, r.tbt_slo) for r in recs] == [(0.5, 0.5)] * 2
    s = summarize(recs, ttft_slo=100.0, tbt_slo=100.0)  # per-request SLOs win
    assert s.slo_attainment == pytest.approx(0.5)  # B meets, A does not


# ----------------------------------------------------------------------------- across runs


def test_effective_throughput() -> None:
    assert effective_throughput([1, 2, 3, 4], [0.99, 0.95, 0.92, 0.5]) == 3
    # unsorted input
    assert effective_throughput([4, 1, 3, 2], [0.5, 0.99, 0.92, 0.95]) == 3
    # non-monotonic: 4 passes again after 3 failed -> does not count
    assert effective_throughput([1, 2, 3, 4], [0.99, 0.95, 0.85, 0.95]) == 2
    assert effective_throughput([1, 2], [0.9, 0.9]) == 2  # threshold is inclusive
    assert effective_throughput([1, 2], [0.5, 0.99]) is None  # lowest fails
    assert effective_throughput([], []) is None
    assert effective_throughput([1, 2], [0.95, None]) == 1
    assert effective_throughput([1, 2], [0.95, math.nan]) == 1
    assert effective_throughput([1.0, 2.0], [0.8, 0.8], threshold=0.75) == 2.0
    with pytest.raises(ValueError):
        effective_throughput([1, 2], [0.9])


def test_interpolated_crossing() -> None:
    # 90% is crossed a fifth of the way from 3 (0.95) to 4 (0.70): not rounded to 3.
    assert interpolated_crossing([2, 3, 4], [1.0, 0.95, 0.70], 0.9) == pytest.approx(3.2)
    assert interpolated_crossing([2, 3], [0.8, 0.5], 0.9) == 0.0  # below the grid
    assert interpolated_crossing([2, 3], [1.0, 0.95], 0.9) == math.inf  # above it
    # the first crossing counts; rising values (violations) with `rising`
    assert interpolated_crossing([1, 2, 3, 4], [1.0, 0.8, 0.95, 0.5], 0.9) == pytest.approx(1.5)
    assert interpolated_crossing([4, 5, 6], [0.0, 0.05, 0.25], 0.1, rising=True) == pytest.approx(5.25)


def test_tail_excess_latency() -> None:
    assert tail_excess_latency([0.1, 0.5, 1.2], 0.4) == pytest.approx(0.1 + 0.8)
    assert tail_excess_latency([0.1, 0.2], 0.4) == 0.0
    assert tail_excess_latency([], 0.4) == 0.0
    assert tail_excess_latency(np.array([1.0, 2.0]), 0.0) == pytest.approx(3.0)


def test_tbt_slo_on_tpot_judges_the_mean_gap_not_the_p99():
    # one slow gap among fast ones: P99 TBT over the SLO, TPOT (LayerKV's SLO) within it
    times = (1.0, 1.1, 1.2, 1.3, 2.0)  # gaps .1 .1 .1 .7: TPOT 0.25, P99 ~0.68
    r = RequestRecord("a", 0.0, 1.0, 2.0, times, prompt_len=4, output_len=5, tbt_slo=0.3)
    assert tbt_slo_met(r) is False and tbt_slo_met(r, on="p99-tbt") is False
    assert tbt_slo_met(r, on="tpot") is True
    s = summarize([r], tbt_slo_on="tpot")
    assert s.tbt_slo_attainment == 1.0 and s.slo_attainment == 1.0 and s.tbt_slo_on == "tpot"
    assert summarize([r]).tbt_slo_attainment == 0.0
    assert "TBT (tpot)" in format_table(s, vllm_report([r], s))
    with pytest.raises(ValueError, match="tpot"):
        summarize([r], tbt_slo_on="mean")


def test_window_medians_by_arrival_order() -> None:
    # Given out of arrival order: A (TTFT 1.0, arrives 0), B (0.5, arrives 1), C (aborted,
    # arrives 2). Two windows: [A] and [B, C]; C has no TTFT. One window: median of 1.0, 0.5.
    assert window_medians([C, B, A], ttft, 2) == [1.0, 0.5]
    assert window_medians([A, B, C], ttft, 1) == [0.75]
    assert window_medians([C], ttft, 1) == [None]
    assert window_medians([A, B], ttft, 3) == [None, 1.0, 0.5]
    with pytest.raises(ValueError):
        window_medians([A], ttft, 0)


def test_max_tbt_asks_every_gap_to_meet_the_slo() -> None:
    # A's gaps .5 1.0 .5: its worst gap is 1.0, its P99 0.99; an SLO of 0.995 lies between.
    assert max_tbt(A) == pytest.approx(1.0)
    assert max_tbt(C) is None
    r = dataclasses.replace(A, tbt_slo=0.995)
    assert tbt_slo_met(r, on="p99-tbt") is True and tbt_slo_met(r, on="max-tbt") is False
    one = rec("one", 0.0, (1.0,), tbt_slo=0.1)  # no gap: met vacuously
    assert tbt_slo_met(one, on="max-tbt") is True
    s = summarize([r, one, dataclasses.replace(C, tbt_slo=5.0)], tbt_slo_on="max-tbt")
    assert s.tbt_slo_attainment == pytest.approx(1 / 3) and s.tbt_slo_on == "max-tbt"


def test_percentiles_of_any_series() -> None:
    # linear: index q/100 * (n - 1) into the sorted values
    assert percentiles([4.0, 1.0, 3.0, 2.0], (0, 50, 90, 100)) == pytest.approx([1.0, 2.5, 3.7, 4.0])
    assert percentiles(np.array([2.0]), [99]) == [2.0]
    assert percentiles([], (50, 99)) == [None, None]
    assert percentiles((x for x in (1.0, 2.0)), (50,)) == [1.5]  # any iterable, read once


def test_ratio_is_nan_without_two_usable_figures() -> None:
    assert ratio(3.0, 2.0) == 1.5
    for a, b in ((None, 1.0), (1.0, None), (0.0, 1.0), (1.0, 0.0), (math.inf, 1.0), (1.0, math.inf),
                 (-1.0, 1.0)):
        assert math.isnan(ratio(a, b))


def test_assign_slos_takes_a_seed_sequence() -> None:
    # CacheOpt's reproduction seeds its SLO draws with [seed, 13]: U[0.5, 2.5] factors of that stream
    got = assign_slos(3, 2.0, 0.1, (0.5, 2.5), [7, 13])
    want = np.random.default_rng([7, 13]).uniform(0.5, 2.5, size=(3, 2)) * [2.0, 0.1]
    np.testing.assert_array_equal(got, want)
    assert got != assign_slos(3, 2.0, 0.1, (0.5, 2.5), 7)
