"""Attention backends: how a layer writes its new K/V and attends, picked by name.

`auto` is the jnp reference on CPU, where XLA runs it well, and the Pallas (Triton) kernels
on GPU. Any backend can be forced by name, e.g. to run the reference on a GPU when a kernel
is in doubt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.kv_write import write_kv_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference


@dataclass(frozen=True)
class AttentionBackend:
    """An `AttentionFn` built from a KV write, a ragged kernel and an optional decode kernel."""

    name: str
    write_kv: Callable
    ragged: Callable
    decode: Callable | None = None  # one query token per sequence; None: use `ragged`

    @property
    def specialises_decode(self) -> bool:
        """Whether the runner should mark all-decode steps (`meta.decode_only`)."""
        return self.decode is not None

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
        meta: AttentionMetadata, *, scale: float,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        k_pages, v_pages = self.write_kv(k_pages, v_pages, k, v, meta.slot_mapping)
        attend = self.decode if meta.decode_only and self.decode is not None else self.ragged
        return attend(q, k_pages, v_pages, meta, scale=scale), k_pages, v_pages


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "reference": AttentionBackend("reference", write_kv_reference, ragged_paged_attention_reference),
}


def select_attention(name: str = "auto") -> AttentionBackend:
    if name == "auto":
        gpu = "pallas" in ATTENTION_BACKENDS and jax.default_backend() == "gpu"
        name = "pallas" if gpu else "reference"
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(["auto", *sorted(ATTENTION_BACKENDS)])
        raise ValueError(f"unknown attention backend {name!r}; known: {known}") from None
