"""Cost model: step shapes from batches, roofline sanity on OPT-13B / A100-80G, calibrated
fit, profile round trip, KV capacity, and the errors a user can cause."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jserve.cache_features.layer_offload.batch import LayerTraffic
from jserve.engine.batch import Batch
from jserve.engine.preemption_costs import PreemptionCosts, SweetSpot
from jserve.runners.cost_model import (
    FEATURES,
    JAX_PUT_LATENCY,
    CalibratedCostModel,
    RooflineCostModel,
    StepShape,
    SwapPath,
    features,
    nnls,
    overlap_layers,
    recompute_time,
    swap_time,
)
from jserve.runners.engine_overhead import KERNELS_ONLY
from jserve.runners.hardware import HARDWARE, Hardware, get_hardware, kv_capacity_blocks
from jserve.runners.preemption_cost import fit_preemption_costs, profile_cost_model
from jserve.models.registry import get_config

OPT13B = get_config("opt-13b")
A100 = get_hardware("a100-80g")


def make_batch(start: list[int], query_lens: list[int]) -> Batch:
    """A Batch with only what the cost model reads filled in meaningfully."""
    s = len(start)
    q = np.asarray(query_lens, np.int32)
    kwargs = dict(seq_ids=np.arange(s, dtype=np.int64), start=np.asarray(start, np.int32),
                  query_lens=q, sample=np.ones(s, bool))
    if "token_ids" in {f.name for f in dataclasses.fields(Batch)}:  # inputs inline in Batch
        kwargs.update(
            token_ids=np.zeros(int(q.sum()), np.int32), block_tables=tuple(np.zeros(1, np.int32) for _ in range(s)),
            temperature=np.zeros(s, np.float32), top_p=np.ones(s, np.float32), top_k=np.zeros(s, np.int32),
            seeds=np.zeros(s, np.uint32), output_index=np.zeros(s, np.int32))
    return Batch(**kwargs)


# -- StepShape ---------------------------------------------------------------------------


def test_shape_of_decodes():
    shape = StepShape.of(make_batch([9, 0, 99], [1, 1, 1]))
    # each decode attends to its whole context start+1 and reads it once
    assert shape == StepShape(num_seqs=3, num_prefill_tokens=0, num_decode_tokens=3,
                              attended=10 + 1 + 100, kv_read_tokens=10 + 1 + 100,
                              decode_context=10 + 1 + 100)


def test_shape_of_mixed_chunks_and_decodes():
    # chunk of 4 tokens after 6 cached: attends 7+8+9+10 = 34, reads 10
    # fresh prefill of 3: attends 1+2+3 = 6, reads 3
    # decode at context 20: attends 20, reads 20
    shape = StepShape.of(make_batch([6, 0, 19], [4, 3, 1]))
    assert shape.num_seqs == 3
    assert shape.num_prefill_tokens == 7
    assert shape.num_decode_tokens == 1
    assert shape.num_tokens == 8
    assert shape.attended == 34 + 6 + 20
    assert shape.kv_read_tokens == 10 + 3 + 20
    # as measured kernels split it: chunks against themselves and their prefix, decodes' context
    assert (shape.prefill_square, shape.prefill_prefix, shape.decode_context) == (16 + 9, 4 * 6, 20)
    assert (shape.swap_bytes, shape.layer_bytes, shape.hidden_tokens) == (0, None, 0)
    assert not shape.moves_cache


def test_shape_brute_force_and_constructors():
    rng = np.random.default_rng(0)
    start = rng.integers(0, 5000, 50)
    q = rng.integers(1, 600, 50)
    shape = StepShape.from_lens(start, q)
    assert shape.attended == sum(int(s) + j + 1 for s, n in zip(start, q) for j in range(n))
    assert shape.kv_read_tokens == int((start + q).sum())
    assert StepShape.prefill(5, start=2) == StepShape.from_lens([2], [5])
    assert StepShape.decode([3, 7]) == StepShape.from_lens([2, 6], [1, 1])
    assert StepShape.of(make_batch([], [])).num_tokens == 0
    # large contexts do not overflow int32 arithmetic
    big = StepShape.from_lens(np.array([2_000_000] * 4, np.int32), np.array([60_000] * 4, np.int32))
    assert big.attended == 4 * (60_000 * 2_000_000 + 60_000 * 60_001 // 2)


# -- roofline ----------------------------------------------------------------------------


def test_decode_batch1_memory_bound_at_weights_over_bandwidth():
    model = RooflineCostModel(OPT13B, A100)
    shape = StepShape.decode([512])
    parts = model.breakdown(shape)
    assert parts["memory"] > 20 * parts["compute"]
    weights = OPT13B.num_params * 2
    assert 25e9 < weights < 27e9
    assert parts["memory"] == pytest.approx(weights / (A100.hbm_bandwidth * A100.mbu), rel=0.05)
    assert 13e-3 < parts["memory"] < 17e-3
    assert model.step_time(shape) == pytest.approx(parts["memory"] + model.overhead_time(shape))


def test_prefill_2048_compute_bound():
    model = RooflineCostModel(OPT13B, A100)
    parts = model.breakdown(StepShape.prefill(2048))
    assert parts["compute"] > 5 * parts["memory"]
    # 2 * 12.9e9 * 2048 FLOPs at 312 TFLOPS * 0.6, plus causal attention
    assert 0.25 < model.step_time(StepShape.prefill(2048)) < 0.35


def test_step_time_monotone_in_tokens_and_context():
    model = RooflineCostModel(OPT13B, A100)
    for hw in HARDWARE.values():
        m = RooflineCostModel(OPT13B, hw)
        times = [m.step_time(StepShape.prefill(n)) for n in (1, 16, 256, 1024, 4096)]
        assert times == sorted(times) and times[0] < times[-1]
        ctx = [m.step_time(StepShape.decode([c] * 32)) for c in (16, 256, 2048, 16384)]
        assert ctx == sorted(ctx) and ctx[0] < ctx[-1]
        batch = [m.step_time(StepShape.decode([512] * b)) for b in (1, 8, 64, 256)]
        assert batch == sorted(batch) and batch[0] < batch[-1]
    # a faster device is faster
    assert (RooflineCostModel(OPT13B, get_hardware("h100")).step_time(StepShape.prefill(2048))
            < model.step_time(StepShape.prefill(2048)))
    # tensor parallelism divides the work and adds its all-reduces
    tp2 = RooflineCostModel(OPT13B, A100, tensor_parallel=2, engine=KERNELS_ONLY)
    tp1 = RooflineCostModel(OPT13B, A100, engine=KERNELS_ONLY)
    shape = StepShape.prefill(512)
    assert tp1.communication_time(shape) == 0
    assert tp2.step_time(shape) == pytest.approx(tp1.step_time(shape) / 2 + tp2.communication_time(shape))


def test_extras_are_charged():
    model = RooflineCostModel(OPT13B, A100)
    base = StepShape.decode([512] * 8)
    assert model.step_time(StepShape(0, 0, 0, 0, 0)) == 0.0
    swapped = dataclasses.replace(base, swap_bytes=10**9)
    assert model.step_time(swapped) - model.step_time(base) == pytest.approx(1e9 / A100.pcie_bandwidth)
    # hidden tokens cost K/V projection FLOPs; a big prefill with them is slower
    prefill = StepShape.prefill(2048, start=2048)
    hidden = dataclasses.replace(prefill, hidden_tokens=2048)
    extra = 4 * OPT13B.hidden_size * OPT13B.hidden_size * OPT13B.num_layers * 2048 / (A100.peak_flops * A100.mfu)
    assert model.step_time(hidden) - model.step_time(prefill) == pytest.approx(extra, rel=1e-6)
    assert recompute_time(model, 2048) == model.step_time(StepShape.prefill(2048))
    assert recompute_time(model, 0) == 0.0


def test_a_vllm_v0_swap_pays_a_copy_per_block_per_layer_for_k_and_v():
    model = RooflineCostModel(OPT13B, A100)  # the default: vLLM v0's swap_blocks
    bpb = 16 * OPT13B.kv_bytes_per_token
    copies = 3 * 2 * OPT13B.num_layers  # 3 blocks, K and V of each of 40 layers
    expected = copies * A100.copy_latency + 3 * bpb / A100.pcie_bandwidth
    assert model.step_time(StepShape.swap(3, bpb)) == pytest.approx(expected)
    # the step waits for its swaps: a decode step that also swaps costs both
    decode = StepShape.decode([512] * 8)
    both = dataclasses.replace(decode, swap_bytes=3 * bpb, swap_blocks=3, swap_moves=1)
    assert model.step_time(both) == pytest.approx(model.step_time(decode) + expected)


def test_a_gathered_swap_pays_one_put_per_request_and_the_device_gather():
    model = RooflineCostModel(OPT13B, A100, swap_path=SwapPath.GATHERED)
    bpb = 16 * OPT13B.kv_bytes_per_token
    expected = (2 * JAX_PUT_LATENCY + 6 * bpb / A100.pcie_bandwidth
                + 2 * 6 * bpb / (A100.hbm_bandwidth * A100.mbu))
    assert model.step_time(StepShape.swap(6, bpb, moves=2)) == pytest.approx(expected)


def test_swap_time_is_a_requests_blocks_out_and_back_in():
    model = RooflineCostModel(OPT13B, A100)
    bpb = 16 * OPT13B.kv_bytes_per_token
    assert swap_time(model, 0, 16, bpb) == 0.0
    # 33 tokens fill 3 blocks of 16; each goes out and comes back
    assert swap_time(model, 33, 16, bpb) == pytest.approx(model.step_time(StepShape.swap(6, bpb, moves=2)))
    assert swap_time(model, 33, 16, bpb) == pytest.approx(2 * model.step_time(StepShape.swap(3, bpb)))


# -- calibrated ---------------------------------------------------------------------------


def synthetic_samples(coef: np.ndarray, n: int = 400, noise: float = 0.02, seed: int = 0):
    """Steps like a profiler would time: decode batches of varied size and context, prefill
    chunks of varied count, length and offset, and mixes of both."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = i % 3  # 0: decodes only, 1: prefills only, 2: mixed
        num_decode = int(rng.integers(1, 256)) if kind != 1 else 0
        num_prefill = int(rng.integers(1, 16)) if kind != 0 else 0
        start = np.concatenate([rng.integers(1, 4096, num_decode), rng.integers(0, 2048, num_prefill)])
        q = np.concatenate([np.ones(num_decode, np.int64), rng.integers(2, 1024, num_prefill)])
        shape = StepShape.from_lens(start, q)
        t = float(coef @ features(shape))
        out.append((shape, t * (1 + noise * rng.standard_normal())))
    return out


# Roughly OPT-13B on an A100: 5 ms fixed, 0.14 ms per prefill token, 4.4 ns per attended
# token, 0.5 us per KV token read; small per-decode and per-sequence costs.
# The padding features stay zero here (shapes of an unpadded runner).
TRUE_COEF = np.array([5e-3, 1.4e-4, 5e-5, 2e-5, 4.4e-9, 5e-7, 0.0, 0.0])


def test_fit_recovers_coefficients_exactly_without_noise():
    model = CalibratedCostModel.fit(synthetic_samples(TRUE_COEF, n=60, noise=0.0))
    np.testing.assert_allclose(model.coefficients, TRUE_COEF, rtol=1e-6)


def test_fit_with_noise_recovers_identifiable_coefficients_and_predicts():
    model = CalibratedCostModel.fit(synthetic_samples(TRUE_COEF, noise=0.02), model_name="opt-13b", device="synthetic")
    got = np.array(model.coefficients)
    # intercept, prefill tokens and KV reads are well determined ...
    np.testing.assert_allclose(got[[0, 1, 5]], TRUE_COEF[[0, 1, 5]], rtol=0.05)
    np.testing.assert_allclose(got[4], TRUE_COEF[4], rtol=0.4)
    # ... decode tokens and sequences are nearly collinear (seqs = decodes + prefill seqs):
    # only their sum, the cost of one decoding sequence, is
    assert got[2] + got[3] == pytest.approx(TRUE_COEF[2] + TRUE_COEF[3], rel=0.4)
    assert np.sqrt(np.mean(model.fit_errors() ** 2)) < 0.03
    for shape, true_t in synthetic_samples(TRUE_COEF, n=60, noise=0.0, seed=7):
        assert model.step_time(shape) == pytest.approx(true_t, rel=0.03)


def test_fit_never_returns_negative_coefficients():
    coef = TRUE_COEF.copy()
    coef[3] = 0.0  # seqs cost nothing; noise would push an unconstrained fit negative
    for seed in range(3):
        model = CalibratedCostModel.fit(synthetic_samples(coef, n=60, noise=0.1, seed=seed))
        assert min(model.coefficients) >= 0


def test_nnls_matches_lstsq_when_unconstrained_and_clips_otherwise():
    rng = np.random.default_rng(1)
    a = rng.random((50, 4))
    x_true = np.array([1.0, 2.0, 0.5, 3.0])
    np.testing.assert_allclose(nnls(a, a @ x_true), x_true, rtol=1e-8)
    x = nnls(a, a @ np.array([1.0, -2.0, 0.5, 3.0]))
    assert x.min() >= 0 and x[1] == 0


def test_profile_round_trip(tmp_path):
    model = CalibratedCostModel.fit(synthetic_samples(TRUE_COEF, n=30), model_name="opt-13b", device="A100-SXM4-80GB")
    path = tmp_path / "profiles" / "opt13b.json"
    model.save(path)
    loaded = CalibratedCostModel.load(path)
    assert loaded == model
    assert CalibratedCostModel.from_json(model.to_json()) == model
    assert CalibratedCostModel.from_json(str(path)) == model
    d = model.to_dict()
    assert d["model"] == "opt-13b" and d["device"] == "A100-SXM4-80GB"
    assert d["features"] == list(FEATURES) and d["fit"]["num_samples"] == 30
    shape = StepShape.prefill(300, start=40)
    assert loaded.step_time(shape) == model.step_time(shape)


def test_calibrated_extras_need_a_roofline():
    model = CalibratedCostModel.fit(synthetic_samples(TRUE_COEF, n=30))
    swapped = dataclasses.replace(StepShape.decode([100] * 4), swap_bytes=10**8)
    with pytest.raises(ValueError, match="extras"):
        model.step_time(swapped)
    with_extras = model.with_extras(RooflineCostModel(OPT13B, A100))
    assert with_extras.step_time(swapped) == pytest.approx(
        model.step_time(StepShape.decode([100] * 4)) + 1e8 / A100.pcie_bandwidth)


def test_calibrated_errors(tmp_path):
    samples = synthetic_samples(TRUE_COEF, n=30)
    with pytest.raises(ValueError, match="at least"):
        CalibratedCostModel.fit(samples[:3])
    decodes_only = [(StepShape.decode([c] * b), 0.01 + 1e-4 * b) for b in (1, 2, 4) for c in (10, 100, 1000)]
    with pytest.raises(ValueError, match="num_prefill_tokens"):
        CalibratedCostModel.fit(decodes_only)
    with pytest.raises(ValueError, match="> 0"):
        CalibratedCostModel.fit([(s, -1.0) for s, _ in samples])
    with pytest.raises(ValueError, match="weighting"):
        CalibratedCostModel.fit(samples, weighting="squared")
    with pytest.raises(ValueError, match="does not exist"):
        CalibratedCostModel.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CalibratedCostModel.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="profile"):
        CalibratedCostModel.load(tmp_path / "other.json")


# -- hardware and capacity ------------------------------------------------------------------


def test_kv_capacity_opt13b_a100_80g():
    blocks = kv_capacity_blocks(OPT13B, A100, block_size=16, utilization=0.9)
    # (0.9 * 80 GiB - 25.7 GB weights - ~0.8 GB reserve) / 13.1 MB per 16-token block
    assert 3000 < blocks < 4500
    assert 48_000 < blocks * 16 < 72_000
    assert kv_capacity_blocks(OPT13B, A100, block_size=32) == pytest.approx(blocks / 2, abs=1)
    assert kv_capacity_blocks(OPT13B, A100, 16, utilization=0.5) < blocks
    assert kv_capacity_blocks(OPT13B, A100, 16, tensor_parallel=2) > 2 * blocks
    assert kv_capacity_blocks(OPT13B, get_hardware("a100-40g"), 16) < blocks
    assert kv_capacity_blocks(OPT13B, get_hardware("h200"), 16) > 2 * blocks


def test_kv_capacity_errors():
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(--tensor-parallel-size\) >= 5"):
        kv_capacity_blocks(get_config("opt-175b"), A100, 16)
    assert kv_capacity_blocks(get_config("opt-175b"), A100, 16, tensor_parallel=8) > 0
    with pytest.raises(ValueError, match=r"tensor-parallel-size\) >= 2"):
        kv_capacity_blocks(get_config("opt-30b"), get_hardware("a100-40g"), 16)
    with pytest.raises(ValueError, match="block_size"):
        kv_capacity_blocks(OPT13B, A100, 0)
    with pytest.raises(ValueError, match="utilization"):
        kv_capacity_blocks(OPT13B, A100, 16, utilization=1.5)


def test_hardware_table_and_errors():
    assert set(HARDWARE) == {"a100-40g", "a100-80g", "h100", "h200", "l20"}
    assert get_hardware("H100") is HARDWARE["h100"]
    assert HARDWARE["h200"].peak_flops == HARDWARE["h100"].peak_flops
    assert HARDWARE["h200"].hbm_bandwidth > HARDWARE["h100"].hbm_bandwidth > HARDWARE["a100-80g"].hbm_bandwidth
    with pytest.raises(ValueError, match="a100-40g, a100-80g, h100, h200, l20"):
        get_hardware("v100")
    with pytest.raises(ValueError, match="mfu"):
        Hardware("x", 1e12, 1e12, 1e10, 1e10, mfu=1.5)
    with pytest.raises(ValueError, match="memory_bytes"):
        Hardware("x", 1e12, 1e12, 1e10, 0)


def test_step_shape_models_a_bucketed_runner_when_given_its_padding():
    from jserve.engine.batch import Batch

    batch = Batch(seq_ids=np.arange(3), start=np.array([40, 0, 7]), query_lens=np.array([1, 9, 1]),
                  sample=np.ones(3, bool))
    plain = StepShape.of(batch)
    assert (plain.padded_tokens, plain.page_walk) == (0, 0)
    padded = StepShape.of(batch, pad=lambda n: 16)
    assert (padded.padded_tokens, padded.page_walk) == (16, 16 * 40)
    assert dataclasses.replace(padded, padded_tokens=0, page_walk=0) == plain


# -- preemption costs: the paper's L_r / L_s fits and their crossing ------------------------

KNOWN = PreemptionCosts(a=2e-9, b=2.0, k=1e-4, e=0.01, g=1.5e-4, d=0.002)


def test_fit_recovers_known_polynomials_and_their_crossing():
    sizes = [16, 64, 256, 1024, 2048, 4096, 8192]
    fitted = fit_preemption_costs(sizes, [KNOWN.recompute(n) for n in sizes], [KNOWN.swap(n) for n in sizes])
    for got, want in zip(dataclasses.astuple(fitted), dataclasses.astuple(KNOWN)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    # 2e-9 S^2 - 5e-5 S + 0.008 = 0: roots (5e-5 +- sqrt(2.5e-9 - 6.4e-11)) / 4e-9
    upper = (5e-5 + np.sqrt(5e-5**2 - 4 * 2e-9 * 0.008)) / 4e-9
    assert fitted.solve() == SweetSpot("crossing", int(np.ceil(upper)))
    assert fitted.prefers_swap(1)  # swap also wins at one token, yet the sweet spot is the crossing
    assert not fitted.prefers_swap(fitted.sweet_spot() - 1) and fitted.prefers_swap(fitted.sweet_spot())


def test_fit_with_a_free_exponent_finds_it():
    sizes = [16, 64, 256, 1024, 2048, 4096]
    true = dataclasses.replace(KNOWN, a=3e-7, b=1.5)
    fitted = fit_preemption_costs(sizes, [true.recompute(n) for n in sizes], [true.swap(n) for n in sizes],
                                  exponent=None)
    assert fitted.b == pytest.approx(1.5) and fitted.a == pytest.approx(3e-7, rel=1e-6)


def test_sweet_spot_kinds_are_data():
    always = PreemptionCosts(a=0.0, b=1.0, k=2e-4, e=0.01, g=1e-4, d=0.0)
    assert always.solve() == SweetSpot("always", 0) and always.sweet_spot() == 0
    never = PreemptionCosts(a=0.0, b=1.0, k=1e-4, e=0.01, g=2e-4, d=0.0)
    assert never.solve(limit=4096) == SweetSpot("never", 4096) and never.sweet_spot(4096) == 4096
    one_root = PreemptionCosts(a=1e-6, b=2.0, k=0.0, e=1e-3, g=2e-5, d=2e-3)  # recompute wins at 1
    assert one_root.solve() == SweetSpot("crossing", 44)
    with pytest.raises(ValueError, match="b >= 1"):
        PreemptionCosts(a=1.0, b=0.5, k=0.0, e=0.0, g=0.0, d=0.0)


def test_fit_of_the_cost_model_agrees_with_its_profile():
    """OPT-13B on A100-80G, vLLM v0 swap: at block 32 swap beats recompute at every profiled
    length and the fit says always; at block 8 it loses from 128 tokens on and the fitted
    crossing lies past the 2,048-token context."""
    model = RooflineCostModel(OPT13B, A100)
    for block, kind in ((32, "always"), (8, "crossing")):
        profile = profile_cost_model(model, block, block * OPT13B.kv_bytes_per_token)
        spot = profile.fit().solve()
        assert spot.kind == kind
        faster = [w < r for r, w in zip(profile.recompute_s, profile.swap_s)]
        assert all(faster) if kind == "always" else (not any(faster[3:]) and spot.tokens > 2048)


# --------------------------------------------------------------------------- LayerKV transfers
def _layers(n: int, prefill_to_host=0, to_host=0, to_device=0, device_copy=0) -> LayerTraffic:
    return LayerTraffic(*((v,) * n for v in (prefill_to_host, to_host, to_device, device_copy)))


def test_layer_transfers_are_pipelined_with_the_layers_compute():
    model = RooflineCostModel(OPT13B, A100)
    L = OPT13B.num_layers
    prefill = StepShape.prefill(2048)
    work = max(model.compute_time(prefill), model.memory_time(prefill))
    per_layer = 2048 * 2 * OPT13B.num_kv_heads * OPT13B.head_dim * 2  # one layer's K and V
    # every layer of the prompt written out as it computes: hidden but for one layer's copy
    out = dataclasses.replace(prefill, layer_bytes=_layers(L, prefill_to_host=per_layer))
    copy = L * per_layer / A100.pcie_bandwidth
    assert copy < work
    assert model.step_time(out) - model.step_time(prefill) == pytest.approx(copy / L)
    assert model.breakdown(out)["layer_transfer"] == pytest.approx(copy)
    # a decode bringing many layers back is bound by the link: X + C / L
    decode = StepShape.decode([512] * 8)
    back = dataclasses.replace(decode, layer_bytes=_layers(L, to_device=10 * per_layer))
    link = 10 * copy
    dwork = max(model.compute_time(decode), model.memory_time(decode))
    assert link > dwork
    assert model.step_time(back) == pytest.approx(link + dwork / L + model.overhead_time(back))
    # the link is full duplex: retained layers written out as others come back cost no more
    both = dataclasses.replace(back, layer_bytes=_layers(L, to_host=10 * per_layer, to_device=10 * per_layer))
    assert model.step_time(both) == pytest.approx(model.step_time(back))
    # a step that only moves layers costs the moves; slots copied into whole blocks cost HBM
    only = StepShape(0, 0, 0, 0, 0, layer_bytes=_layers(L, to_host=per_layer))
    assert model.step_time(only) == pytest.approx(copy)
    local = StepShape(0, 0, 0, 0, 0, layer_bytes=_layers(L, device_copy=per_layer))
    assert model.step_time(local) == pytest.approx(2 * L * per_layer / (A100.hbm_bandwidth * A100.mbu))
    assert only.moves_cache and not decode.moves_cache
    with pytest.raises(ValueError, match="repeat"):
        only.one_token_on()


def test_overlap_layers_with_uneven_copies():
    none = np.zeros(4)
    assert overlap_layers(4.0, none, none, none) == 4.0
    # one layer of 1 s compute each; layer 2 brought back in 3 s: compute waits for it
    assert overlap_layers(4.0, np.array([0, 0, 3.0, 0]), none, none) == pytest.approx(3 + 2)
    # writes after compute of 2 s each queue behind each other: 1 + 4 * 2
    assert overlap_layers(4.0, none, none, np.full(4, 2.0)) == pytest.approx(9.0)
    # uniform: L max(c, x) + min(c, x)
    assert overlap_layers(40.0, np.full(40, 0.5), np.zeros(40), np.zeros(40)) == pytest.approx(40 + 0.5)


def test_calibrated_model_pipelines_layer_transfers_too():
    extras = RooflineCostModel(OPT13B, A100)
    fitted = CalibratedCostModel(tuple(TRUE_COEF), extras=extras)
    decode = StepShape.decode([512] * 8)
    back = dataclasses.replace(decode, layer_bytes=_layers(OPT13B.num_layers, to_device=10**8))
    assert fitted.step_time(back) == pytest.approx(extras.layered_time(fitted.step_time(decode), back))
    assert fitted.step_time(back) > extras.layer_transfer_time(back)
    with pytest.raises(ValueError, match="extras"):
        CalibratedCostModel(tuple(TRUE_COEF)).step_time(back)


def test_profiles_written_with_host_layer_tokens_still_load():
    d = StepShape.prefill(16).to_dict()
    assert StepShape.from_dict({**d, "host_layer_tokens": 0}) == StepShape.prefill(16)
    with pytest.raises(ValueError, match="host_layer_tokens"):
        StepShape.from_dict({**d, "host_layer_tokens": 5})
