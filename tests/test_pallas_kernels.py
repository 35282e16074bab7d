"""The Pallas kernels other than ragged/decode attention (whose tests run every backend in
test_ragged_paged_attention.py), interpreted on CPU (compiled where JAX's backend is a GPU)
against their jnp references, and a check that every kernel lowers to Triton for CUDA, which
catches what the interpreter accepts and Triton does not (non-power-of-two tiles,
unsupported ops)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import GEOMETRIES, assert_close, build_case, interpret, mixed_case, oracle

from jserve.pallas_kernels.block_copy import (
    gather_blocks, gather_blocks_reference, scatter_blocks, scatter_blocks_reference,
)
from jserve.pallas_kernels.hidden_attention import (
    KVProjection, hidden_paged_attention, hidden_paged_attention_reference,
)
from jserve.pallas_kernels.kv_write import write_kv, write_kv_reference, write_pages
from jserve.pallas_kernels.paged_decode_attention import paged_decode_attention
from jserve.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention, ragged_paged_attention_reference,
)
from jserve.pallas_kernels.rope import rope
from jserve.pallas_kernels.row_copy import copy_rows, copy_rows_reference

INTERPRET = interpret()


@pytest.mark.parametrize("width", [1, 48, 200, 3000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_copy_rows_matches_reference(width, dtype):
    rng = np.random.default_rng(width)
    src = jnp.asarray(rng.standard_normal((9, width)), dtype)
    dst = jnp.asarray(rng.standard_normal((20, width)), dtype)
    src_rows = jnp.asarray(rng.integers(0, 9, 6), jnp.int32)
    dst_rows = jnp.asarray(rng.permutation(20)[:6], jnp.int32)
    got = copy_rows(src, src_rows, dst, dst_rows, block=128, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(copy_rows_reference(src, src_rows, dst, dst_rows)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blocks_swap_through_host_memory_bit_identically(dtype):
    """Gather a request's blocks, move them to host memory and back, scatter them into other
    free blocks: the K/V come back bit for bit, and no other block changes."""
    rng = np.random.default_rng(4)
    pool = jnp.asarray(rng.standard_normal((12, 4, 3, 16)), dtype)
    out_ids = jnp.asarray([7, 2, 9], jnp.int32)
    in_ids = jnp.asarray([0, 11, 5], jnp.int32)
    buf = gather_blocks(pool, out_ids, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(buf), np.asarray(gather_blocks_reference(pool, out_ids)))
    memory = partial(jax.sharding.SingleDeviceSharding, jax.devices()[0])
    on_host = jax.device_put(buf, memory(memory_kind="pinned_host"))
    assert on_host.sharding.memory_kind == "pinned_host"
    back = jax.device_put(on_host, memory(memory_kind="device"))
    got = scatter_blocks(pool, in_ids, back, interpret=INTERPRET)
    want = scatter_blocks_reference(pool, in_ids, buf)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got)[np.asarray(in_ids)], np.asarray(pool)[np.asarray(out_ids)])
    untouched = np.setdiff1d(np.arange(12), np.asarray(in_ids))
    np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(pool)[untouched])


def test_write_kv_matches_reference_for_non_power_of_two_rows():
    rng = np.random.default_rng(1)
    case = mixed_case(rng, 9, 3, 32, 4)  # 3 KV heads: 96-value rows
    meta = jax.tree.map(jnp.asarray, case.meta)
    args = [jnp.asarray(x) for x in (case.k_pages, case.v_pages, case.k_new, case.v_new)]
    got = write_kv(*args, meta.slot_mapping, interpret=INTERPRET)
    want = [write_pages(p, n, meta.slot_mapping) for p, n in ((args[0], args[2]), (args[1], args[3]))]
    for g, w in zip(got, want):
        # padding tokens all target the scratch block; compare everything else exactly
        np.testing.assert_array_equal(np.asarray(g)[:-1], np.asarray(w)[:-1])


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_k,keys_per_split", [(16, 32), (32, 64)])
def test_one_row_decode_matches_oracle(block_k, keys_per_split, dtype, tol):
    """The decode kernel's `one_row` path (no GQA: multiply-reduce instead of 16-row dots)
    over contexts of 1 to 256 tokens: empty, partial and full splits, padded sequences."""
    rng = np.random.default_rng(block_k)
    starts = [0, 1, 15, 16, 31, 32, 100, 255] + list(rng.integers(0, 256, 4))
    case = build_case(rng, [(int(s), 1) for s in starts], heads=4, kv_heads=4, head_dim=32,
                      block_size=16, max_model_len=256)
    meta = jax.tree.map(jnp.asarray, case.meta)
    kp, vp, k, v, q = (jnp.asarray(x, dtype) for x in (case.k_pages, case.v_pages, case.k_new,
                                                        case.v_new, case.q))
    kp, vp = write_kv_reference(kp, vp, k, v, meta.slot_mapping)
    got = paged_decode_attention(q, kp, vp, meta, scale=32**-0.5, block_k=block_k,
                                 keys_per_split=keys_per_split, one_row=True, interpret=INTERPRET)
    assert_close(np.asarray(got.astype(jnp.float32), np.float64), oracle(case, dtype),
                 case.t_real, tol, tol)


def _hidden_case(rng, geometry, hidden: int, dtype):
    heads, kv_heads, head_dim, block_size = geometry
    case = mixed_case(rng, heads, kv_heads, head_dim, block_size)
    meta = jax.tree.map(jnp.asarray, case.meta)
    pool = jnp.asarray(rng.standard_normal((case.k_pages.shape[0], block_size, hidden)), dtype)
    new = jnp.asarray(rng.standard_normal((case.q.shape[0], hidden)), dtype)
    return case, meta, write_pages(pool, new, meta.slot_mapping), jnp.asarray(case.q, dtype)


def _projection(rng, hidden: int, width: int, dtype, *, bias: bool, theta: float | None):
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), dtype)  # noqa: E731
    return KVProjection(w(hidden, width), w(hidden, width), w(width) if bias else None,
                        w(width) if bias else None, theta)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("geometry,hidden,bias,theta", [
    (GEOMETRIES[0], 64, False, 10000.0),  # MHA, Llama-style
    (GEOMETRIES[1], 80, True, None),  # GQA 3, OPT-style biases, hidden not a tile multiple
    (GEOMETRIES[2], 48, True, 500.0),  # GQA 8, bias and RoPE
])
def test_hidden_attention_kernel_matches_reference(geometry, hidden, bias, theta, dtype, tol):
    rng = np.random.default_rng(hidden)
    case, meta, pool, q = _hidden_case(rng, geometry, hidden, dtype)
    proj = _projection(rng, hidden, geometry[1] * geometry[2], dtype, bias=bias, theta=theta)
    scale = geometry[2] ** -0.5
    want = hidden_paged_attention_reference(q, pool, proj, meta, scale=scale)
    got = hidden_paged_attention(q, pool, proj, meta, scale=scale, block_m=16, block_k=16,
                                 block_d=32, interpret=INTERPRET)
    got, want = (np.asarray(x.astype(jnp.float32))[: case.t_real] for x in (got, want))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("theta", [None, 10000.0])
def test_hidden_reference_is_paged_attention_over_projected_pages(theta):
    """With identity projections the hidden rows are the keys: the reference must equal the
    ragged reference over pages holding those keys, roped at each slot's logical position."""
    geometry = GEOMETRIES[1]
    _, kv_heads, head_dim, block_size = geometry
    rng = np.random.default_rng(6)
    case, meta, pool, q = _hidden_case(rng, geometry, kv_heads * head_dim, jnp.float32)
    eye = jnp.eye(kv_heads * head_dim)
    got = hidden_paged_attention_reference(q, pool, KVProjection(eye, eye, rope_theta=theta), meta,
                                           scale=head_dim**-0.5)
    v_pages = pool.reshape(*pool.shape[:2], kv_heads, head_dim)
    k_pages = v_pages
    if theta is not None:
        slots = np.concatenate([t[np.arange(s + q) // block_size] * block_size + np.arange(s + q) % block_size
                                for t, s, q in zip(case.tables, case.starts, case.qlens)])
        pos = np.concatenate([np.arange(s + q) for s, q in zip(case.starts, case.qlens)])
        flat = v_pages.reshape(-1, kv_heads, head_dim)
        k_pages = flat.at[slots].set(rope(flat[slots], jnp.asarray(pos), theta)).reshape(v_pages.shape)
    want = ragged_paged_attention_reference(q, k_pages, v_pages, meta, scale=head_dim**-0.5)
    np.testing.assert_allclose(np.asarray(got)[: case.t_real], np.asarray(want)[: case.t_real],
                               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- lowering to Triton


def _lower_for_cuda(fn, *args) -> str:
    """StableHLO of `fn` lowered for CUDA. Without a GPU attached, JAX >= 0.11 takes the target
    GPU from an abstract device (an A100, the oldest GPU jserve supports); older JAX falls back
    to a default compute capability by itself."""
    lower = lambda: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()  # noqa: E731
    if jax.default_backend() == "gpu" or not hasattr(jax.sharding, "AbstractDevice"):
        return lower()
    a100 = jax.sharding.AbstractDevice(device_kind="NVIDIA A100", num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=a100)):
        return lower()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("geometry", GEOMETRIES[:3])
def test_kernels_lower_to_triton_for_cuda(geometry, dtype):
    heads, kv_heads, head_dim, block_size = geometry
    rng = np.random.default_rng(0)
    case = build_case(rng, [(5, 1), (0, 7), (20, 3)], heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, block_size=block_size)
    meta = jax.tree.map(jnp.asarray, case.meta)
    q, kp, vp, k, v = (jnp.asarray(x, dtype) for x in (case.q, case.k_pages, case.v_pages,
                                                        case.k_new, case.v_new))
    hidden = jnp.zeros((kp.shape[0], block_size, 96), dtype)
    proj = _projection(rng, 96, kv_heads * head_dim, dtype, bias=True, theta=10000.0)
    scale = head_dim**-0.5
    kernels = {
        "ragged": lambda: _lower_for_cuda(partial(ragged_paged_attention, scale=scale), q, kp, vp, meta),
        "decode": lambda: _lower_for_cuda(partial(paged_decode_attention, scale=scale), q, kp, vp, meta),
        "decode, one row": lambda: _lower_for_cuda(
            partial(paged_decode_attention, scale=scale, one_row=True), q, kp, vp, meta),
        "kv write": lambda: _lower_for_cuda(write_kv, kp, vp, k, v, meta.slot_mapping),
        "gather": lambda: _lower_for_cuda(gather_blocks, kp, jnp.arange(3)),
        "scatter": lambda: _lower_for_cuda(scatter_blocks, kp, jnp.arange(3), kp[:3]),
        "hidden": lambda: _lower_for_cuda(partial(hidden_paged_attention, scale=scale), q, hidden,
                                          proj, meta),
    }
    for name, lower in kernels.items():
        assert "__gpu$xla.gpu.triton" in lower(), name
