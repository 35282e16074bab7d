"""The T-LRU paper's own model (`jserve.benchmarking.paper_cache.PaperCache`), driven
through jserve's eviction rules: one request at a time, no queueing, TTFT linear in
uncached tokens (so TEL counts uncached tokens past xi), every conversation's whole history
cached after its turn and then trimmed to the capacity (sum_i X_i <= C, Algorithm 1).
Block size 1, so blocks are tokens.

- Figure 1: two conversations, capacity 100. LRU evicts all of A after step 2, so a third
  turn from A computes 200 tokens; T-LRU (xi = 150, Q_hat = 100) keeps 50 of each, so
  either third turn computes 150 (25% less). The caption gives the capacity, the 200 vs 150
  and the 50/50 split; the step sizes (A 100, B 100, then a 100-token prompt) and xi = 150
  are what reproduce them.
- Threshold-LRU (Section 6.2): a conversation is cached only once its history exceeds
  the threshold, all of it or nothing.
- Section 4: with the next prompt's length known (Q_hat = its true length), T-LRU's TEL is
  never above LRU's, checked on random small traces.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jserve.benchmarking.paper_cache import PaperCache, uncached_per_turn
from jserve.policies.tail_optimized_lru import make_eviction_rule


def figure1(rule_name: str) -> PaperCache:
    cache = PaperCache(100, make_eviction_rule(rule_name, q_hat=100.0, xi_tokens=150.0))
    assert cache.turn("A", 100, 0, now=1.0) == 100
    assert cache.turn("B", 100, 0, now=2.0) == 100
    return cache


def test_figure1_lru_evicts_all_of_a() -> None:
    cache = figure1("lru")
    assert cache.evicted == [("A", d) for d in range(100)]
    assert cache.cached == {"A": 0, "B": 100}
    # The third turn (a 100-token prompt) computes 200 tokens from A, 100 from B.
    assert [cache.history[c] + 100 - cache.cached[c] for c in "AB"] == [200, 100]


def test_figure1_tlru_keeps_fifty_of_each() -> None:
    cache = figure1("tlru")
    # Budgets L + Q_hat - xi = 100 + 100 - 150 = 50: each conversation's blocks 50-99 are
    # surplus; trimming them is enough (LRU never runs).
    assert cache.evicted == sorted([("A", d) for d in range(50, 100)] + [("B", d) for d in range(50, 100)])
    assert cache.cached == {"A": 50, "B": 50}
    assert [cache.history[c] + 100 - cache.cached[c] for c in "AB"] == [150, 150]
    # Either third turn: T-LRU's worst is 150 tokens against LRU's 200 (25% less), and with
    # xi = 150 neither adds tail excess, where LRU's A adds 50.
    for cid, lru_uncached in (("A", 200), ("B", 100)):
        t = figure1("tlru").turn(cid, 100, 0, now=3.0)
        assert t == 150 and max(t - 150, 0) <= max(lru_uncached - 150, 0)


def test_threshold_lru_caches_only_histories_past_the_threshold() -> None:
    cache = PaperCache(1000, make_eviction_rule("lru"), min_history=150)
    assert cache.turn("A", 100, 50, now=1.0) == 100
    assert cache.cached == {"A": 0}  # 150 tokens: not past the threshold
    assert cache.turn("A", 10, 0, now=2.0) == 160  # recomputes its whole history
    assert cache.cached == {"A": 160}
    assert cache.turn("A", 10, 0, now=3.0) == 10
    # In 16-token blocks (messages round up) the threshold is read in tokens like the rest:
    # 7 + 4 blocks of history are not past 176 tokens, 12 blocks are.
    turns = [(0.0, "A", 100, 50), (1.0, "A", 10, 0), (2.0, "A", 10, 0)]
    assert uncached_per_turn(turns, 1024, make_eviction_rule("lru"), 16, min_history=176).tolist() == [112, 192, 16]


def tel(rule_name: str, trace: list[tuple[str, int]], capacity: int, prompt: int, xi: float) -> float:
    """Tokens past xi summed over the trace's turns, every prompt `prompt` tokens long."""
    cache = PaperCache(capacity, make_eviction_rule(rule_name, q_hat=float(prompt), xi_tokens=xi))
    return sum(max(cache.turn(cid, prompt, resp, now=float(t)) - xi, 0.0)
               for t, (cid, resp) in enumerate(trace))


@st.composite
def traces(draw: st.DrawFn) -> tuple[list[tuple[str, int]], int, int, float]:
    n_conv = draw(st.integers(1, 4))
    trace = draw(st.lists(st.tuples(st.sampled_from([f"c{i}" for i in range(n_conv)]), st.integers(0, 12)),
                          min_size=1, max_size=14))
    return trace, draw(st.integers(0, 40)), draw(st.integers(0, 8)), float(draw(st.integers(0, 30)))


@settings(max_examples=300, deadline=None)
@given(traces())
def test_section4_tlru_tel_never_above_lru(case: tuple[list[tuple[str, int]], int, int, float]) -> None:
    trace, capacity, prompt, xi = case
    assert tel("tlru", trace, capacity, prompt, xi) <= tel("lru", trace, capacity, prompt, xi)
