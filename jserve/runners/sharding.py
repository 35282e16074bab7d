"""Tensor parallelism for the JAX runner: a device mesh, Megatron-style weight shardings and a
KV cache sharded by KV head, all through JAX's own machinery (GSPMD places the collectives: two
all-reduces a layer). Which weights split how, and GQA with fewer KV heads than devices:
docs/serving.md, Tensor parallelism.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jserve.errors import ConfigError
from jserve.models.config import ModelConfig, repeated_kv_columns
from jserve.models.loading import CausalLM, abstract_model
from jserve.models.paged import KVCache, is_stacked
from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.backends import AttentionBackend

AXIS = "tp"

# Parameters by the name of the layer that holds them (the last module name in the path).
COLUMN_PARALLEL = frozenset({"wq", "wk", "wv", "w_gate", "w_up", "q_proj", "k_proj", "v_proj", "fc1"})
ROW_PARALLEL = frozenset({"wo", "w_down", "out_proj", "fc2"})
KV_PROJECTIONS = frozenset({"wk", "wv", "k_proj", "v_proj"})

HEADS = P(None, AXIS, None)  # [T, heads, head_dim]
PAGES = P(None, None, AXIS, None)  # [blocks, block_size, kv_heads, head_dim]
LAYER_PAGES = P(None, *PAGES)  # KVCache's [layers, blocks, block_size, kv_heads, head_dim]
REPLICATED = P()


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """The first `tensor_parallel_size` devices (of every process) on the `tp` axis."""
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} needs that many JAX devices, "
                         f"{len(devices)} exist (on CPU, force more with "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))


def sharded_config(cfg: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """`cfg` as the runner holds it over `tensor_parallel_size` devices: KV heads repeated up
    to one per device where there are fewer (see docs/serving.md). Refuses shapes that do not
    split evenly."""
    tp = tensor_parallel_size
    for name, n in (("num_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
        if n % tp:
            raise ConfigError(f"{cfg.name}: {name}={n} does not split over tensor_parallel_size={tp}")
    kv = cfg.num_kv_heads
    if kv % tp == 0:
        return cfg
    if tp % kv:
        raise ConfigError(f"{cfg.name}: num_kv_heads={kv} neither splits over nor divides "
                         f"tensor_parallel_size={tp}")
    return dataclasses.replace(cfg, num_kv_heads=tp)


def _names(path: tuple) -> list[str]:
    """A parameter's path as names: `layers/wq/kernel/value` -> `[layers, wq, kernel]`."""
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return [n for n in names if isinstance(n, str) and n != "value"]


def _layer_name(path: tuple) -> str:
    """The module a parameter belongs to (`wq` for `layers/wq/kernel`); '' at top level."""
    names = _names(path)
    return names[-2] if len(names) >= 2 else ""


def param_spec(path: tuple) -> P:
    """Megatron-style spec of one parameter, by its path in the model's state (a block
    parameter's leading layer axis is not split)."""
    layer, param = _layer_name(path), _names(path)[-1]
    spec = REPLICATED
    if layer in COLUMN_PARALLEL:
        spec = P(None, AXIS) if param == "kernel" else P(AXIS)
    elif layer in ROW_PARALLEL and param == "kernel":
        spec = P(AXIS, None)
    return P(None, *spec) if is_stacked(path) and spec != REPLICATED else spec


def replicate_kv_heads(model: CausalLM, tensor_parallel_size: int) -> CausalLM:
    """`model` with its KV heads repeated up to `tensor_parallel_size` (a new module; `model`
    is untouched), or `model` itself when its KV heads split as they are (a checkpoint read
    for this mesh is held so already)."""
    cfg = sharded_config(model.cfg, tensor_parallel_size)
    if cfg is model.cfg:
        return model
    columns = repeated_kv_columns(model.cfg, cfg)
    dtype = model.embed.embedding.get_value().dtype
    graphdef, _ = nnx.split(abstract_model(cfg, dtype))

    def repeat_columns(path: tuple, x: jax.Array) -> jax.Array:
        return x[..., columns] if _layer_name(path) in KV_PROJECTIONS else x  # kernel or bias

    state = jax.tree_util.tree_map_with_path(repeat_columns, nnx.state(model))
    return nnx.merge(graphdef, state)


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """The K and V pages of every layer (`KVCache`): split by KV head."""
    return NamedSharding(mesh, LAYER_PAGES)


@dataclass(frozen=True)
class ShardedAttention:
    """An attention backend run per shard: a `shard_map` over the head axis, so each device
    writes and attends with its own heads' K/V through the (replicated) block tables. The
    backend, reference or Pallas, never sees the mesh. Hashable (a static argument of the
    block jit), as `AttentionBackend` is."""

    backend: AttentionBackend
    mesh: Mesh

    @property
    def specialises_decode(self) -> bool:
        return self.backend.specialises_decode

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
        meta: AttentionMetadata, *, scale: float, hidden: jax.Array | None = None,
        proj: object = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`hidden` and `proj` (Apt-Serve's rows and K/V projection) are read by a backend only
        for hidden-cache sequences, which a sharded engine never has (a device's page slice
        holds no whole row; the builder offers no hidden cache under tensor parallelism)."""
        if meta.parts:
            raise ValueError(f"{sorted(meta.parts)} steps do not run under tensor parallelism")
        per_shard = jax.shard_map(
            partial(self.backend, scale=scale), mesh=self.mesh,
            in_specs=(HEADS, HEADS, HEADS, PAGES, PAGES, REPLICATED),
            out_specs=(HEADS, PAGES, PAGES), check_vma=False)
        return per_shard(q, k, v, k_pages, v_pages, meta)

    def gather_blocks(self, pages: jax.Array, ids: jax.Array) -> jax.Array:
        return jax.shard_map(self.backend.gather_blocks, mesh=self.mesh, in_specs=(PAGES, REPLICATED),
                             out_specs=PAGES, check_vma=False)(pages, ids)

    def scatter_blocks(self, pages: jax.Array, ids: jax.Array, blocks: jax.Array) -> jax.Array:
        return jax.shard_map(self.backend.scatter_blocks, mesh=self.mesh,
                             in_specs=(PAGES, REPLICATED, PAGES), out_specs=PAGES,
                             check_vma=False)(pages, ids, blocks)


@dataclass(frozen=True)
class TensorParallel:
    """What the runner needs to run its step over a mesh: where weights, cache and inputs
    live, and the attention wrapper."""

    mesh: Mesh

    @classmethod
    def over(cls, tensor_parallel_size: int) -> TensorParallel:
        return cls(make_mesh(tensor_parallel_size))

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def pages(self) -> NamedSharding:
        """Blocks of one layer (`[blocks, block_size, kv_heads, head_dim]`), as copies gather them."""
        return NamedSharding(self.mesh, PAGES)

    @property
    def cache(self) -> NamedSharding:
        return cache_sharding(self.mesh)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, REPLICATED)

    def prepare(self, model: CausalLM) -> CausalLM:
        return replicate_kv_heads(model, self.size)

    def held_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` as the mesh holds it (a `jserve.models.loading.Placement`)."""
        return sharded_config(cfg, self.size)

    def param_sharding(self, path: tuple) -> NamedSharding:
        """Where the parameter at `path` (in the model's `nnx.State`) goes on the mesh."""
        return NamedSharding(self.mesh, param_spec(path))

    def place_params(self, params: nnx.State) -> nnx.State:
        """`params` on the mesh, each split by its spec (no copy for those read there)."""
        return jax.device_put(params, jax.tree_util.tree_map_with_path(
            lambda path, _: self.param_sharding(path), params))

    def cache_shardings(self, cache: KVCache) -> KVCache:
        return jax.tree.map(lambda _: self.cache, cache)

    def attention(self, backend: AttentionBackend) -> ShardedAttention:
        return ShardedAttention(backend, self.mesh)
