"""Random ragged attention steps and a naive float64 oracle, shared by the tests of the
jnp references and of the Pallas kernels.

Each case is a ragged step laid out the way `JaxRunner` lays it out: decodes, whole
prompts, prefill chunks starting mid-page and one-token prompts mixed in one flat token axis,
followed by padding tokens (position 0, slot in the scratch block) and padded empty sequences
(`query_start` continues at the real token count, `context_len` 0, table of scratch blocks).
Block tables are shuffled, non-contiguous physical blocks. The oracle never looks at the
pages for the step's own tokens: it builds each sequence's full context from the cached
prefix in the initial pool plus the step's new K/V, so it checks the write as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.backends import AttentionBackend, pallas_backend, select_attention

MAX_MODEL_LEN = 64


# --------------------------------------------------------------------------- where kernels run


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def interpret() -> bool:
    """How the kernel tests run the Pallas kernels: compiled (Triton) where JAX's backend is a
    GPU, through the Pallas interpreter everywhere else."""
    return not on_gpu()


# The compiled kernels with the interpreter's small tiles, so that the tests' small cases
# cross tile and split edges on a GPU too.
_PALLAS_SMALL = pallas_backend("pallas-small", block_m=16, block_k=16, keys_per_split=32)


def kernel_backends() -> list[str]:
    """Attention backends the kernel tests check: the jnp reference, and the Pallas kernels
    interpreted (`pallas-interpret`) or, on a GPU, compiled with default and small tiles."""
    return ["reference", "pallas", "pallas-small"] if on_gpu() else ["reference", "pallas-interpret"]


def attention_backend(name: str) -> AttentionBackend:
    return _PALLAS_SMALL if name == "pallas-small" else select_attention(name)


def _pow2_at_least(n: int, floor: int) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


@dataclass
class Case:
    q: np.ndarray  # [T, H, d] (in the case dtype's values, stored as float32)
    k_new: np.ndarray  # [T, KVH, d]
    v_new: np.ndarray
    k_pages: np.ndarray  # [blocks, bs, KVH, d] initial pool (cached prefixes + garbage)
    v_pages: np.ndarray
    meta: AttentionMetadata  # numpy-backed
    starts: list[int]
    qlens: list[int]
    tables: list[np.ndarray]
    t_real: int
    needed_prefix_blocks: int
    max_blocks_per_seq: int


def build_case(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],  # (cached prefix length, query length) per real sequence
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    extra_pad_tokens: int = 3,
    extra_pad_seqs: int = 2,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    max_model_len: int = MAX_MODEL_LEN,
) -> Case:
    """A step of `seqs` padded to `num_tokens`/`num_seqs` (default: JaxRunner-style powers of
    two past the extra padding) over a pool whose size depends only on the block size, so that
    cases of one geometry share their compiled step."""
    bs = block_size
    n = len(seqs)
    starts = [s for s, _ in seqs]
    qlens = [q for _, q in seqs]
    ctx = [s + q for s, q in seqs]
    assert all(c <= max_model_len for c in ctx)
    max_blocks = -(-max_model_len // bs)
    need = [-(-c // bs) for c in ctx]
    num_blocks = 8 * max_blocks + 4  # the last one is the scratch block
    assert sum(need) < num_blocks
    scratch = num_blocks - 1
    perm = rng.permutation(num_blocks - 1)
    tables, off = [], 0
    for b in need:
        tables.append(perm[off : off + b].astype(np.int32))
        off += b

    t_real = sum(qlens)
    t = num_tokens or _pow2_at_least(t_real + extra_pad_tokens, 8)
    s = num_seqs or _pow2_at_least(n + extra_pad_seqs, 8)
    assert t >= t_real and s >= n

    block_tables = np.full((s, max_blocks), scratch, np.int32)
    for i, tab in enumerate(tables):
        block_tables[i, : len(tab)] = tab
    query_start = np.zeros(s + 1, np.int32)
    query_start[1 : n + 1] = np.cumsum(qlens)
    query_start[n + 1 :] = t_real
    context_lens = np.zeros(s, np.int32)
    context_lens[:n] = ctx
    positions = np.zeros(t, np.int32)
    slots = np.full(t, scratch * bs, np.int32)
    tok = 0
    for i, (st_, ql) in enumerate(seqs):
        for j in range(ql):
            p = st_ + j
            positions[tok] = p
            slots[tok] = tables[i][p // bs] * bs + p % bs
            tok += 1
    needed = max((-(-st_ // bs) for st_ in starts), default=0)
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=slots,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=block_tables,
    )
    f = np.float32
    return Case(
        q=rng.standard_normal((t, heads, head_dim)).astype(f),
        k_new=rng.standard_normal((t, kv_heads, head_dim)).astype(f),
        v_new=rng.standard_normal((t, kv_heads, head_dim)).astype(f),
        k_pages=rng.standard_normal((num_blocks, bs, kv_heads, head_dim)).astype(f),
        v_pages=rng.standard_normal((num_blocks, bs, kv_heads, head_dim)).astype(f),
        meta=meta,
        starts=starts,
        qlens=qlens,
        tables=tables,
        t_real=t_real,
        needed_prefix_blocks=needed,
        max_blocks_per_seq=max_blocks,
    )


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """Values as they are after a cast to `dtype`, in float64."""
    return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)


def oracle(case: Case, dtype=jnp.float32) -> np.ndarray:
    """Naive attention per sequence and query token, in float64. Returns `[t_real, H, d]`."""
    q = _round(case.q, dtype)
    k_new, v_new = _round(case.k_new, dtype), _round(case.v_new, dtype)
    k_pages, v_pages = _round(case.k_pages, dtype), _round(case.v_pages, dtype)
    _, heads, d = q.shape
    bs, kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = heads // kv_heads
    out = np.zeros((case.t_real, heads, d))
    tok = 0
    for start, ql, table in zip(case.starts, case.qlens, case.tables):
        ctx = start + ql
        k = np.zeros((ctx, kv_heads, d))
        v = np.zeros((ctx, kv_heads, d))
        for p in range(start):  # cached prefix: from the pool, through the block table
            k[p] = k_pages[table[p // bs], p % bs]
            v[p] = v_pages[table[p // bs], p % bs]
        k[start:] = k_new[tok : tok + ql]  # this step's tokens
        v[start:] = v_new[tok : tok + ql]
        for j in range(ql):
            for h in range(heads):
                kh = h // group
                scores = k[: start + j + 1, kh] @ q[tok + j, h] / np.sqrt(d)
                w = np.exp(scores - scores.max())
                w /= w.sum()
                out[tok + j, h] = w @ v[: start + j + 1, kh]
        tok += ql
    return out


def _mixed_seqs(rng: np.random.Generator, bs: int) -> list[tuple[int, int]]:
    """Decodes, whole prompts, mid-page chunks and a one-token prompt, shuffled."""

    def mid_page_start() -> int:
        s = int(rng.integers(1, 40))
        return s + 1 if s % bs == 0 else s

    seqs = [
        (int(rng.integers(1, 50)), 1),  # decode
        (int(rng.integers(1, 50)), 1),  # decode
        (bs * int(rng.integers(1, 5)) - 1, 1),  # decode whose new token opens a new page
        (0, int(rng.integers(2, 14))),  # whole prompt
        (0, 1),  # one-token prompt
        (mid_page_start(), int(rng.integers(2, 12))),  # chunk starting mid-page
        (mid_page_start(), int(rng.integers(2, 12))),
        (bs * int(rng.integers(1, 4)), int(rng.integers(2, 9))),  # chunk starting on a page edge
    ]
    return [seqs[i] for i in rng.permutation(len(seqs))]


def mixed_case(rng, heads, kv_heads, head_dim, block_size) -> Case:
    return build_case(rng, _mixed_seqs(rng, block_size), heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, block_size=block_size, num_tokens=64, num_seqs=16)


GEOMETRIES = [  # heads, kv_heads, head_dim, block_size
    (8, 8, 64, 16),
    (9, 3, 32, 4),
    (8, 1, 64, 4),
    (9, 3, 64, 16),
]


def assert_close(got: np.ndarray, want: np.ndarray, t_real: int, rtol: float, atol: float) -> None:
    assert np.all(np.isfinite(got)), "padding outputs must be finite too"
    np.testing.assert_allclose(got[:t_real], want, rtol=rtol, atol=atol)


