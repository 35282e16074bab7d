#!/usr/bin/env python
"""Achieved bandwidth of each Pallas kernel against a measured copy bandwidth, with the jnp
reference's time beside it, in one run.

For each kernel the script counts the fewest bytes the operation must move (each input
read once, each output written once: for attention, Q, O and every sequence's K/V; for the
KV write, the new K/V read and written; for block gather/scatter, the blocks read and
written; for hidden-cache attention, the hidden rows, the K/V weights, Q and O), times the
kernel and its reference (median of `--repeats` runs after warm-up, outputs ready), and
reports bytes/s and its fraction of the bandwidth of a large device-to-device copy measured
in the same run.

On GPU it runs the Pallas kernels (Triton backend) and the references, at the sizes of a
Llama-2-7B layer. On CPU the Pallas kernels only run interpreted, which measures nothing,
so it runs the references only, at smaller sizes, and says so.

On GPU it also sets our paged decode kernel beside JAX's own (deprecated)
`jax.experimental.pallas.ops.gpu.paged_attention` on the same inputs (its pages transposed
to its `[kv_heads, pages, page_size, d]` layout before timing, the scale applied to q
inside the timed call, which it does not do itself), each checked against the reference,
and with `--sweep` times our decode kernel over tile sizes, splits, warps and pipeline
stages.

Usage::

    python bench/kernels.py                 # table on stdout, JSON in bench/results/
    python bench/kernels.py --repeats 50 --sweep --output my.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
from dataclasses import asdict, dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from device_timing import (
    copy_bandwidth, device_name, median_seconds, on_gpu, random_like, results_tag, today,
)

from jserve.pallas_kernels.attention_metadata import AttentionMetadata, ragged_metadata
from jserve.pallas_kernels.block_copy import (
    gather_blocks, gather_blocks_reference, scatter_blocks, scatter_blocks_reference,
)
from jserve.pallas_kernels.hidden_attention import (
    KVProjection, hidden_paged_attention, hidden_paged_attention_reference,
)
from jserve.pallas_kernels.kv_write import write_kv, write_kv_reference
from jserve.pallas_kernels.paged_decode_attention import paged_decode_attention
from jserve.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention, ragged_paged_attention_reference,
)

RESULTS = pathlib.Path(__file__).parent / "results"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Sizes:
    heads: int
    kv_heads: int
    head_dim: int
    decode_seqs: int
    decode_context: int
    prefill: tuple[tuple[int, int], ...]  # (cached prefix, new tokens) per sequence
    swap_blocks: int
    hidden: int
    hidden_seqs: int
    hidden_context: int
    copy_bytes: int


GPU_SIZES = Sizes(heads=32, kv_heads=32, head_dim=128, decode_seqs=64, decode_context=2048,
                  prefill=((0, 512),) * 4 + ((768, 256),) * 4, swap_blocks=512, hidden=4096,
                  hidden_seqs=16, hidden_context=1024, copy_bytes=1 << 30)
CPU_SIZES = Sizes(heads=32, kv_heads=32, head_dim=128, decode_seqs=8, decode_context=512,
                  prefill=((0, 128),) * 2 + ((128, 64),) * 2, swap_blocks=64, hidden=1024,
                  hidden_seqs=2, hidden_context=256, copy_bytes=1 << 28)


@dataclass
class Row:
    kernel: str
    shape: str
    bytes: int
    pallas_s: float | None
    reference_s: float
    copy_bytes_per_s: float

    @property
    def pallas_fraction(self) -> float | None:
        return None if self.pallas_s is None else self.bytes / self.pallas_s / self.copy_bytes_per_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["pallas_bytes_per_s"] = None if self.pallas_s is None else self.bytes / self.pallas_s
        d["reference_bytes_per_s"] = self.bytes / self.reference_s
        d["pallas_fraction_of_copy"] = self.pallas_fraction
        d["reference_fraction_of_copy"] = self.bytes / self.reference_s / self.copy_bytes_per_s
        return d


def step_metadata(seqs: tuple[tuple[int, int], ...], num_blocks: int, rng: np.random.Generator,
                  decode_only: bool = False) -> AttentionMetadata:
    """Device metadata for `(prefix, new tokens)` sequences over shuffled distinct blocks."""
    need = [-(-(p + q) // BLOCK_SIZE) for p, q in seqs]
    ids = rng.permutation(num_blocks - 1).astype(np.int32)
    tables = np.split(ids[: sum(need)], np.cumsum(need)[:-1])
    t = sum(q for _, q in seqs)
    meta = ragged_metadata(
        np.array([p for p, _ in seqs]), np.array([q for _, q in seqs]), tables,
        num_tokens=1 << (t - 1).bit_length(), num_seqs=len(seqs), max_blocks=max(need),
        block_size=BLOCK_SIZE, scratch_block=num_blocks - 1, decode_only=decode_only)
    return jax.tree.map(jnp.asarray, meta)


def kv_pool(sz: Sizes, tokens: int, dtype, seed: int) -> tuple[jax.Array, jax.Array]:
    shape = (-(-tokens // BLOCK_SIZE) + 1, BLOCK_SIZE, sz.kv_heads, sz.head_dim)
    return random_like(shape, dtype, seed), random_like(shape, dtype, seed + 1)


def itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def attention_rows(sz: Sizes, dtype, rng, copy_bps: float, gpu: bool, repeats: int) -> list[Row]:
    rows = []
    scale = sz.head_dim**-0.5
    cases = [
        ("paged decode attention", ((sz.decode_context - 1, 1),) * sz.decode_seqs, True),
        ("ragged paged attention (prefill + chunks)", sz.prefill, False),
    ]
    for name, seqs, decode in cases:
        total = sum(p + q for p, q in seqs)
        k_pages, v_pages = kv_pool(sz, total + BLOCK_SIZE * len(seqs), dtype, seed=len(rows))
        meta = step_metadata(seqs, k_pages.shape[0], rng, decode_only=decode)
        t = meta.positions.shape[0]
        q = random_like((t, sz.heads, sz.head_dim), dtype, seed=7)
        kv_bytes = 2 * total * sz.kv_heads * sz.head_dim * itemsize(dtype)
        nbytes = kv_bytes + 2 * q.nbytes
        kernel = paged_decode_attention if decode else ragged_paged_attention
        ref = jax.jit(partial(ragged_paged_attention_reference, scale=scale))
        pallas = jax.jit(partial(kernel, scale=scale)) if gpu else None
        rows.append(Row(
            name, f"{len(seqs)} seqs, {total} keys, {sz.heads}/{sz.kv_heads} heads, {jnp.dtype(dtype).name}",
            nbytes,
            median_seconds(lambda: pallas(q, k_pages, v_pages, meta), repeats=repeats) if gpu else None,
            median_seconds(lambda: ref(q, k_pages, v_pages, meta), repeats=repeats), copy_bps))
    return rows


def relative_error(got: jax.Array, want: jax.Array) -> float:
    """||got - want|| / ||want|| in float32."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def decode_case(sz: Sizes, dtype, rng):
    """The paged decode attention inputs: `decode_seqs` sequences at `decode_context`."""
    seqs = ((sz.decode_context - 1, 1),) * sz.decode_seqs
    total = sum(p + q for p, q in seqs)
    k_pages, v_pages = kv_pool(sz, total + BLOCK_SIZE * len(seqs), dtype, seed=100)
    meta = step_metadata(seqs, k_pages.shape[0], rng, decode_only=True)
    q = random_like((meta.positions.shape[0], sz.heads, sz.head_dim), dtype, seed=101)
    nbytes = 2 * total * sz.kv_heads * sz.head_dim * itemsize(dtype) + 2 * q.nbytes
    return q, k_pages, v_pages, meta, nbytes


def decode_comparison(sz: Sizes, dtype, rng, copy_bps: float, repeats: int,
                      sweep: bool) -> list[dict]:
    """Our decode kernel (default and, with `sweep`, other launch parameters) and JAX's
    deprecated Triton paged attention on one set of inputs: time, GB/s, share of the copy
    bandwidth and relative error against the jnp reference."""
    import warnings

    q, k_pages, v_pages, meta, nbytes = decode_case(sz, dtype, rng)
    scale = sz.head_dim**-0.5
    want = jax.jit(partial(ragged_paged_attention_reference, scale=scale))(q, k_pages, v_pages, meta)
    rows = []

    def add(name: str, params: dict, fn, to_ours=lambda out: out) -> None:
        try:
            out = to_ours(fn())
            err = relative_error(out[meta.query_start[:-1]], want[meta.query_start[:-1]])
            t = median_seconds(fn, repeats=repeats)
        except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported
            print(f"  {name} {params}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append(dict(kernel=name, params=params, error=f"{type(e).__name__}: {e}"[:2000]))
            return
        bps = nbytes / t
        rows.append(dict(kernel=name, params=params, seconds=t, bytes=nbytes, bytes_per_s=bps,
                         fraction_of_copy=bps / copy_bps, relative_error=err))
        print(f"  {name:<34} {str(params):<78} {t * 1e3:8.3f} ms {bps / 1e9:8.1f} GB/s "
              f"{100 * bps / copy_bps:5.1f}%  rel err {err:.1e}", flush=True)

    interpret = not on_gpu()  # only to check this function on CPU: times nothing useful there
    ours = [dict()]
    if sweep:
        ours += [dict(num_stages=3), dict(num_stages=1), dict(block_k=128, num_warps=8),
                 dict(block_k=32), dict(keys_per_split=256), dict(keys_per_split=1024),
                 dict(num_warps=8), dict(one_row=True), dict(one_row=True, block_k=32),
                 dict(one_row=True, block_k=128, num_warps=8), dict(one_row=True, num_warps=8),
                 dict(one_row=True, keys_per_split=1024), dict(one_row=True, num_stages=3)]
    print("paged decode attention, ours vs JAX's:", flush=True)
    for params in ours:
        f = jax.jit(partial(paged_decode_attention, scale=scale, interpret=interpret, **params))
        add("ours (paged_decode_attention)", params, lambda f=f: f(q, k_pages, v_pages, meta))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
        except ImportError as e:
            print(f"  JAX's paged_attention is not importable here: {e}")
            return rows
    kt, vt = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k_pages, v_pages))  # [kv, pages, bs, d]
    jax.block_until_ready((kt, vt))
    tables, lengths, first = meta.block_tables, meta.context_lens, meta.query_start[:-1]
    pages = tables.shape[1]

    def scatter_back(out):  # [seqs, heads, d] -> our [T, heads, d] layout
        return jnp.zeros_like(q).at[first].set(out.astype(q.dtype))

    theirs = [dict()] + [dict(k_splits=k) for k in (4, 8, 32) if pages % k == 0]
    if sweep:
        theirs += [dict(pages_per_compute_block=4), dict(num_warps=4)]
    for params in theirs:
        f = jax.jit(lambda q, kt, vt, tables, lengths, params=params: paged_attention(
            q[first] * jnp.asarray(scale, q.dtype), kt, vt, tables, lengths, interpret=interpret,
            **params))
        add("JAX ops.gpu.paged_attention", params, lambda f=f: f(q, kt, vt, tables, lengths),
            scatter_back)
    return rows


def in_place(fn, donated: int, args: list[jax.Array]):
    """A call of `fn` that donates its first `donated` arguments and feeds the results back
    in, as the engine does with its pool: an update in place, no pool copy timed."""
    step = jax.jit(fn, donate_argnums=tuple(range(donated)))

    def run():
        out = step(*args)
        if donated:
            args[:donated] = out if isinstance(out, tuple) else (out,)
        return out

    return run


def data_movement_rows(sz: Sizes, dtype, rng, copy_bps: float, gpu: bool, repeats: int) -> list[Row]:
    tokens = sum(q for _, q in sz.prefill)
    k_pages, v_pages = kv_pool(sz, 4 * tokens, dtype, seed=11)
    free = (k_pages.shape[0] - 1) * BLOCK_SIZE
    slots = jnp.asarray(rng.permutation(free)[:tokens].astype(np.int32))
    k, v = (random_like((tokens, sz.kv_heads, sz.head_dim), dtype, s) for s in (12, 13))
    ids = jnp.asarray(rng.permutation(k_pages.shape[0] - 1)[: sz.swap_blocks].astype(np.int32))
    blocks = k_pages[ids]
    block_kib = blocks[0].nbytes >> 10
    cases = [  # name, shape, bytes, kernel, reference, number of donated args, fresh args
        ("KV write", f"{tokens} tokens x {sz.kv_heads * sz.head_dim} values",
         2 * (k.nbytes + v.nbytes), write_kv, write_kv_reference, 2,
         lambda: [jnp.copy(k_pages), jnp.copy(v_pages), k, v, slots]),
        ("block gather (swap out)", f"{sz.swap_blocks} blocks of {block_kib} KiB", 2 * blocks.nbytes,
         gather_blocks, gather_blocks_reference, 0, lambda: [k_pages, ids]),
        ("block scatter (swap in)", f"{sz.swap_blocks} blocks of {block_kib} KiB", 2 * blocks.nbytes,
         scatter_blocks, scatter_blocks_reference, 1, lambda: [jnp.copy(v_pages), ids, blocks]),
    ]  # donated pools are fresh copies per run: a donated buffer is gone after its call
    rows = []
    for name, shape, nbytes, kernel, reference, donated, args in cases:
        pallas_s = median_seconds(in_place(kernel, donated, args()), repeats=repeats) if gpu else None
        rows.append(Row(name, shape, nbytes, pallas_s,
                        median_seconds(in_place(reference, donated, args()), repeats=repeats),
                        copy_bps))
    return rows


def hidden_rows(sz: Sizes, dtype, rng, copy_bps: float, gpu: bool, repeats: int) -> list[Row]:
    seqs = ((sz.hidden_context - 1, 1),) * sz.hidden_seqs
    total = sz.hidden_context * sz.hidden_seqs
    pool = random_like((total // BLOCK_SIZE + sz.hidden_seqs + 1, BLOCK_SIZE, sz.hidden), dtype, 21)
    meta = step_metadata(seqs, pool.shape[0], rng)
    width = sz.kv_heads * sz.head_dim
    proj = KVProjection(random_like((sz.hidden, width), dtype, 22) * sz.hidden**-0.5,
                        random_like((sz.hidden, width), dtype, 23) * sz.hidden**-0.5,
                        rope_theta=10000.0)
    q = random_like((meta.positions.shape[0], sz.heads, sz.head_dim), dtype, 24)
    nbytes = total * sz.hidden * itemsize(dtype) + proj.wk.nbytes + proj.wv.nbytes + 2 * q.nbytes
    scale = sz.head_dim**-0.5
    pallas = jax.jit(partial(hidden_paged_attention, scale=scale))
    ref = jax.jit(partial(hidden_paged_attention_reference, scale=scale))
    return [Row(
        "hidden-cache attention (decode)",
        f"{sz.hidden_seqs} seqs x {sz.hidden_context} keys, hidden {sz.hidden}", nbytes,
        median_seconds(lambda: pallas(q, pool, proj, meta), repeats=repeats) if gpu else None,
        median_seconds(lambda: ref(q, pool, proj, meta), repeats=repeats), copy_bps)]


def print_table(rows: list[Row], copy_bps: float, gpu: bool) -> None:
    print(f"\nmeasured copy bandwidth: {copy_bps / 1e9:.1f} GB/s (read + write)")
    head = f"{'kernel':<42} {'shape':<44} {'pallas GB/s':>11} {'% copy':>7} {'ref GB/s':>9} {'pallas/ref':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        ref_bps = r.bytes / r.reference_s / 1e9
        if r.pallas_s is None:
            pallas, frac, speed = "-", "-", "-"
        else:
            pallas = f"{r.bytes / r.pallas_s / 1e9:.1f}"
            frac = f"{100 * r.pallas_fraction:.0f}%"
            speed = f"{r.reference_s / r.pallas_s:.2f}x"
        print(f"{r.kernel:<42} {r.shape:<44} {pallas:>11} {frac:>7} {ref_bps:>9.1f} {speed:>10}")
    if not gpu:
        print("\nCPU: Pallas kernels only run interpreted here, which times nothing useful; "
              "references only. Run on a GPU for the kernels.")
    else:
        decode = next(r for r in rows if r.kernel == "paged decode attention")
        ok = decode.pallas_fraction >= 0.8
        print(f"\ngoal: paged decode attention >= 80% of copy bandwidth: "
              f"{100 * decode.pallas_fraction:.0f}% {'PASS' if ok else 'MISS'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per figure (median)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--sweep", action="store_true",
                    help="GPU: also time the decode kernel over launch parameters")
    ap.add_argument("--output", default=None,
                    help="JSON path (default: bench/results/kernels_<device>.json)")
    args = ap.parse_args()
    gpu = on_gpu()
    sz = GPU_SIZES if gpu else CPU_SIZES
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    rng = np.random.default_rng(0)
    copy_bps = copy_bandwidth(sz.copy_bytes)
    rows = []
    for group in (attention_rows, data_movement_rows, hidden_rows):
        new = group(sz, dtype, rng, copy_bps, gpu, args.repeats)
        print(f"timed: {', '.join(r.kernel for r in new)}", flush=True)
        rows += new
    comparison = decode_comparison(sz, dtype, rng, copy_bps, args.repeats, args.sweep) if gpu else []
    print_table(rows, copy_bps, gpu)
    out = pathlib.Path(args.output or RESULTS / f"kernels_{results_tag()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": device_name(), "date": today(), "dtype": dtype.name, "sizes": asdict(sz),
        "copy_bytes_per_s": copy_bps, "pallas_ran": gpu, "rows": [r.as_dict() for r in rows],
        "decode_comparison": comparison, "jax_version": jax.__version__,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
