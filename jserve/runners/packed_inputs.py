"""A step's host inputs as one buffer of 32-bit words, sent to the device in one transfer.

A jitted call converts each numpy argument on its own: about 4 us an array on this CPU,
against 0.7 us for one already on the device (`bench/step_arguments.py`), and a step's
inputs are some two dozen small arrays (tokens, metadata, sampling settings, flags). Packed,
they cross once, and the program cuts them apart again at offsets its bucket's shapes fix,
as vLLM's model runner fills one persistent input buffer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True)
class Layout:
    """Where each leaf of the packed tree lies: (first word, shape, dtype), in leaf order.
    Static (hashable), so that a program is traced once per layout, that is per bucket."""

    treedef: Any
    leaves: tuple[tuple[int, tuple[int, ...], str], ...]


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class Packed:
    """A pytree of numpy arrays of 32-bit or bool dtypes, as one int32 vector `words`."""

    words: Any  # [N] int32
    layout: Layout

    def tree_flatten(self) -> tuple[tuple[Any], Layout]:
        return (self.words,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children: tuple[Any]) -> Packed:
        return cls(children[0], layout)

    @classmethod
    def of(cls, tree: Any) -> Packed:
        """`tree`'s leaves, each as its 32-bit words (bools as 0 / 1), one after another."""
        leaves, treedef = jax.tree.flatten(tree)
        parts, specs, at = [], [], 0
        for leaf in leaves:
            a = np.asarray(leaf)
            if a.dtype == np.bool_:
                words = a.astype(np.int32)
            elif a.dtype.itemsize == 4:
                words = np.ascontiguousarray(a).view(np.int32)
            else:
                raise TypeError(f"a step input of dtype {a.dtype} cannot be packed as 32-bit words")
            parts.append(words.reshape(-1))
            specs.append((at, a.shape, a.dtype.str))
            at += a.size
        words = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return cls(words, Layout(treedef, tuple(specs)))

    def unpack(self) -> Any:
        """The tree again (inside a program: static slices of `words`, bit-cast back)."""
        out = []
        for at, shape, dtype in self.layout.leaves:
            words = jax.lax.slice(self.words, (at,), (at + math.prod(shape),)).reshape(shape)
            kind = np.dtype(dtype)
            if kind == np.bool_:
                out.append(words != 0)
            elif kind == np.int32:
                out.append(words)
            else:
                out.append(jax.lax.bitcast_convert_type(words, kind))
        return jax.tree.unflatten(self.layout.treedef, out)
