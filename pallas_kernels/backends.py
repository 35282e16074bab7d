"""Attention backends: how a layer writes its new K/V and attends, picked by name.

- `reference`: the jnp references; what `auto` picks on CPU, where XLA runs them well.
- `pallas`: the Pallas Triton kernels (ragged, split-K decode, KV write); what `auto` picks
  on GPU (A100 and Hopper alike).
- `pallas-interpret`: the same kernels run by the Pallas interpreter on any platform, with
  small tiles so that tests at small sizes cross tile and split edges. For checking and
  debugging the kernels on CPU, not for speed.
- `dense`: the KV write's reference and attention with no loop (`dense_attention`), the
  one path `jax.grad` goes through (training, scoring); slower than the others at serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax

from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.dense_attention import dense_paged_attention
from jserve.pallas_kernels.hidden_attention import (
    KVProjection, hidden_paged_attention, hidden_paged_attention_reference,
)
from jserve.pallas_kernels.block_copy import (
    gather_blocks, gather_blocks_reference, scatter_blocks, scatter_blocks_reference,
)
from jserve.pallas_kernels.kv_write import write_kv, write_kv_reference
from jserve.pallas_kernels.paged_decode_attention import paged_decode_attention
from jserve.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention, ragged_paged_attention_reference,
)


@dataclass(frozen=True)
class AttentionBackend:
    """An `AttentionFn` built from a KV write, a ragged kernel and an optional decode kernel,
    plus the block gather/scatter the runner swaps with."""

    name: str
    write_kv: Callable
    ragged: Callable
    decode: Callable | None = None  # one query token per sequence; None: use `ragged`
    hidden: Callable = hidden_paged_attention_reference  # over hidden rows (Apt-Serve)
    gather_blocks: Callable = gather_blocks_reference
    scatter_blocks: Callable = scatter_blocks_reference

    @property
    def specialises_decode(self) -> bool:
        """Whether the runner should mark all-decode steps (`meta.decode_only`)."""
        return self.decode is not None

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
        meta: AttentionMetadata, *, scale: float, hidden: jax.Array | None = None,
        proj: KVProjection | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Write the step's K/V, then attend; `hidden` and `proj` are for a wrapper that
        keeps some sequences' layer inputs instead (Apt-Serve's hidden cache), which a
        backend of paged KV ignores."""
        if meta.parts:
            raise ValueError(f"the {self.name!r} backend attends over paged KV only; a step with "
                             f"{sorted(meta.parts)} parts runs through those features' wrappers")
        k_pages, v_pages = self.write_kv(k_pages, v_pages, k, v, meta.slot_mapping)
        return self.attend(q, k_pages, v_pages, meta, scale=scale), k_pages, v_pages

    def attend(self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
               *, scale: float) -> jax.Array:
        """Attention over the pages as they are (the step's K/V already written)."""
        attend = self.decode if meta.decode_only and self.decode is not None else self.ragged
        return attend(q, k_pages, v_pages, meta, scale=scale)


def pallas_backend(name: str, *, interpret: bool = False, block_m: int = 64, block_k: int = 64,
                   keys_per_split: int = 512) -> AttentionBackend:
    """The Pallas kernels with the given tiles (tests build compiled small-tile variants)."""
    return AttentionBackend(
        name,
        write_kv=partial(write_kv, interpret=interpret),
        ragged=partial(ragged_paged_attention, block_m=block_m, block_k=block_k,
                       interpret=interpret),
        decode=partial(paged_decode_attention, block_k=block_k,
                       keys_per_split=keys_per_split, interpret=interpret),
        gather_blocks=partial(gather_blocks, interpret=interpret),
        scatter_blocks=partial(scatter_blocks, interpret=interpret),
        # its K/V tiles are computed in registers: at most the kernel's default 32 keys
        hidden=partial(hidden_paged_attention, block_m=block_m, block_k=min(block_k, 32),
                       interpret=interpret),
    )


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "reference": AttentionBackend("reference", write_kv_reference, ragged_paged_attention_reference),
    "dense": AttentionBackend("dense", write_kv_reference, dense_paged_attention),
    "pallas": pallas_backend("pallas"),
    "pallas-interpret": pallas_backend("pallas-interpret", interpret=True, block_m=16,
                                      block_k=16, keys_per_split=32),
}


def select_attention(name: str = "auto") -> AttentionBackend:
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "reference"
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(["auto", *sorted(ATTENTION_BACKENDS)])
        raise ValueError(f"unknown attention backend {name!r}; known: {known}") from None
