"""Every attention backend (KV write + ragged kernel, and the decode kernel on all-decode
steps) against a naive float64 oracle on the random steps of `attention_cases`.

`reference` is the jnp path; `pallas-interpret` runs the Pallas Triton kernels through the
Pallas interpreter on CPU, with small tiles so these sizes cross tile and split edges. Where
JAX's backend is a GPU the kernels run compiled instead: `pallas` (default tiles) and
`pallas-small` (the interpreter's small tiles), see `attention_cases.kernel_backends`.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    GEOMETRIES,
    Case,
    _mixed_seqs,
    assert_close,
    attention_backend,
    build_case,
    kernel_backends,
    mixed_case,
    oracle,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BACKENDS = kernel_backends()


def _step(backend: str, q, kp, vp, k, v, meta, *, scale):
    return attention_backend(backend)(q, k, v, kp, vp, meta, scale=scale)


@partial(jax.jit, static_argnames=("backend", "scale"))
def _step_jit(backend, q, kp, vp, k, v, meta, *, scale):
    return _step(backend, q, kp, vp, k, v, meta, scale=scale)


def run_step(case: Case, backend: str = "reference", dtype=jnp.float32, jit: bool = True,
             decode_only: bool = False):
    meta = jax.tree.map(jnp.asarray, case.meta)
    if decode_only:
        assert all(q == 1 for q in case.qlens)
        meta = dataclasses.replace(meta, decode_only=True)
    scale = 1.0 / float(np.sqrt(case.q.shape[-1]))
    c = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
    step = _step_jit if jit else _step
    out, kp, vp = step(backend, c(case.q), c(case.k_pages), c(case.v_pages), c(case.k_new),
                       c(case.v_new), meta, scale=scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    assert kp.dtype == dtype
    return np.asarray(out.astype(jnp.float32), np.float64), kp, vp


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", GEOMETRIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_matches_oracle(backend, seed, heads, kv_heads, head_dim, block_size):
    rng = np.random.default_rng(seed * 100 + heads * 7 + kv_heads + head_dim + block_size)
    case = mixed_case(rng, heads, kv_heads, head_dim, block_size)
    assert case.needed_prefix_blocks > 0
    want = oracle(case)
    got, _, _ = run_step(case, backend)
    assert_close(got, want, case.t_real, 1e-5, 1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", GEOMETRIES[:3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fresh_prompts_with_zero_prefix_blocks(backend, heads, kv_heads, head_dim, block_size):
    rng = np.random.default_rng(5)
    seqs = [(0, 5), (0, 1), (0, 2 * block_size + 3), (0, block_size)]
    case = build_case(rng, seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, num_tokens=64, num_seqs=16)
    want = oracle(case)
    got, _, _ = run_step(case, backend)
    assert_close(got, want, case.t_real, 1e-5, 1e-5)


@pytest.mark.parametrize("backend,decode_only", [(b, d) for b in BACKENDS for d in (False, True)])
def test_single_decode_of_one_token_context_and_no_padding(backend, decode_only):
    """Length-1 contexts, and a step whose token count fills its bucket exactly."""
    rng = np.random.default_rng(3)
    seqs = [(0, 1)] * 3 + [(1, 1), (3, 1), (4, 1), (15, 1), (16, 1)]
    case = build_case(rng, seqs, heads=9, kv_heads=3, head_dim=32, block_size=4,
                      extra_pad_tokens=0, extra_pad_seqs=0)
    assert case.q.shape[0] == case.t_real == 8 and case.meta.context_lens.shape[0] == 8
    assert_close(run_step(case, backend, decode_only=decode_only)[0], oracle(case), case.t_real,
                 1e-5, 1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", GEOMETRIES[:3])
def test_decode_steps_over_long_contexts(backend, heads, kv_heads, head_dim, block_size, dtype, tol):
    """All-decode steps marked `decode_only` (the split-K kernel under pallas): contexts of 1
    to 256 tokens, so splits are empty, partial and full; padded sequences in the batch."""
    rng = np.random.default_rng(heads + kv_heads + block_size)
    starts = [0, 1, block_size - 1, block_size, 31, 32, 100, 255] + list(rng.integers(0, 256, 4))
    case = build_case(rng, [(int(s), 1) for s in starts], heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, block_size=block_size, max_model_len=256)
    got, _, _ = run_step(case, backend, dtype, decode_only=True)
    assert_close(got, oracle(case, dtype), case.t_real, tol, tol)


def test_jit_matches_eager_and_oracle():
    rng = np.random.default_rng(21)
    case = build_case(rng, [(6, 1), (0, 3), (9, 4), (2, 1)], heads=9, kv_heads=3, head_dim=32,
                      block_size=4)
    got, kp, vp = run_step(case, jit=True)
    eager, kpe, vpe = run_step(case, jit=False)
    assert_close(got, oracle(case), case.t_real, 1e-5, 1e-5)
    np.testing.assert_allclose(got[: case.t_real], eager[: case.t_real], rtol=1e-6, atol=1e-6)
    # All but the scratch block (last), where every padding token writes: which of those
    # duplicate writes lands is unspecified (on GPU it differed between jit and eager).
    np.testing.assert_array_equal(np.asarray(kp)[:-1], np.asarray(kpe)[:-1])
    np.testing.assert_array_equal(np.asarray(vp)[:-1], np.asarray(vpe)[:-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_touches_only_slots(backend):
    rng = np.random.default_rng(8)
    case = mixed_case(rng, 8, 1, 32, 4)
    _, kp, vp = run_step(case, backend)
    kp, vp = np.asarray(kp), np.asarray(vp)
    bs = kp.shape[1]
    flat_k = kp.reshape(-1, *kp.shape[2:])
    flat_v = vp.reshape(-1, *vp.shape[2:])
    slots = case.meta.slot_mapping
    np.testing.assert_array_equal(flat_k[slots[: case.t_real]], case.k_new[: case.t_real])
    np.testing.assert_array_equal(flat_v[slots[: case.t_real]], case.v_new[: case.t_real])
    untouched = np.ones(flat_k.shape[0], bool)
    untouched[slots] = False
    assert untouched.sum() > 0
    np.testing.assert_array_equal(flat_k[untouched], case.k_pages.reshape(flat_k.shape)[untouched])
    np.testing.assert_array_equal(flat_v[untouched], case.v_pages.reshape(flat_v.shape)[untouched])
    scratch = kp.shape[0] - 1
    assert np.all(slots[case.t_real :] // bs == scratch)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", GEOMETRIES[:3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_pages_and_queries(backend, heads, kv_heads, head_dim, block_size):
    rng = np.random.default_rng(31)
    case = mixed_case(rng, heads, kv_heads, head_dim, block_size)
    want = oracle(case, jnp.bfloat16)
    got, _, _ = run_step(case, backend, jnp.bfloat16)
    assert_close(got, want, case.t_real, 2e-2, 2e-2)
    # beyond the worst case, the typical error is that of rounding the output to bf16
    err = np.abs(got[: case.t_real] - want)
    assert err.mean() < 5e-3


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    geometry=st.sampled_from([(6, 2, 16, 4), (4, 1, 16, 2), (3, 3, 16, 8)]),
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_hypothesis_small_cases(backend, data, geometry):
    heads, kv_heads, head_dim, block_size = geometry
    seqs = data.draw(
        st.lists(
            st.tuples(st.integers(0, 20), st.integers(1, 6)),
            min_size=1,
            max_size=5,
        ),
        label="(start, query_len) per sequence",
    )
    seed = data.draw(st.integers(0, 2**31), label="seed")
    rng = np.random.default_rng(seed)
    case = build_case(rng, seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, num_tokens=32, num_seqs=8)
    assert_close(run_step(case, backend)[0], oracle(case), case.t_real, 1e-5, 1e-5)


def test_metadata_builder_matches_jax_runner_inputs():
    """The layout these tests build is the one `JaxRunner._inputs` builds."""
    from jserve.engine.batch import Batch, BatchDelta, BatchInputs
    from jserve.runners.input_batch import PersistentBatch
    from jserve.runners.jax_runner import Buckets, build_step_inputs

    bs = 4
    rng = np.random.default_rng(2)
    seqs = _mixed_seqs(rng, bs)
    case = build_case(rng, seqs, heads=8, kv_heads=1, head_dim=32, block_size=bs,
                      extra_pad_tokens=0, extra_pad_seqs=0)
    n = len(seqs)
    scratch = case.k_pages.shape[0] - 1
    buckets = Buckets(max_tokens=64, max_seqs=16, max_blocks_per_seq=case.max_blocks_per_seq)
    inputs = BatchInputs(token_ids=np.zeros(case.t_real, np.int32), output_index=np.zeros(n, np.int32),
                         delta=BatchDelta.of_sequences(range(n), case.tables))
    batch = Batch(seq_ids=np.arange(n), start=np.array(case.starts, np.int32),
                  query_lens=np.array(case.qlens, np.int32), sample=np.ones(n, bool), inputs=inputs)
    held = PersistentBatch.holding(inputs.delta, buckets.max_blocks_per_seq, scratch)
    meta = build_step_inputs(batch, buckets, bs, held).batch.meta
    t, s = meta.positions.shape[0], meta.context_lens.shape[0]
    assert t >= case.t_real and s >= n
    ours = case.meta
    np.testing.assert_array_equal(meta.positions[: case.t_real], ours.positions[: case.t_real])
    real = slice(0, case.t_real)
    np.testing.assert_array_equal(meta.slot_mapping[real], ours.slot_mapping[real])
    assert np.all(meta.slot_mapping[case.t_real :] // bs == scratch)
    np.testing.assert_array_equal(meta.query_start[: n + 1], ours.query_start[: n + 1])
    assert np.all(meta.query_start[n + 1 :] == case.t_real)
    np.testing.assert_array_equal(meta.context_lens[:n], ours.context_lens[:n])
    assert np.all(meta.context_lens[n:] == 0)
    np.testing.assert_array_equal(meta.block_tables[:n], ours.block_tables[:n])
    assert np.all(meta.block_tables[n:] == scratch)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", GEOMETRIES[1:3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sequences_spanning_several_query_tiles(backend, heads, kv_heads, head_dim, block_size):
    """Past 128 tokens the in-step part runs in tiles; prompts and chunks cross tile edges."""
    rng = np.random.default_rng(9)
    seqs = [(0, 150), (30, 1), (0, 1), (0, 200), (45, 100), (70, 1), (0, 3)]
    case = build_case(rng, seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, num_tokens=512, num_seqs=16, max_model_len=256)
    got, _, _ = run_step(case, backend)
    assert_close(got, oracle(case), case.t_real, 1e-5, 1e-5)
