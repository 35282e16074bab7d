"""OPT-family decoder (learned positions, pre-LayerNorm, ReLU FFN, MHA) on a paged KV cache.

Follows HF `OPTForCausalLM` with `do_layer_norm_before=True`, the layout of every OPT size
the seed papers serve (13B..175B). Like the Llama model it never owns the cache and takes
its attention backend as an argument, so the runner drives both families the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.models.config import ModelConfig
from jserve.models.paged import AttentionFn, KVCache, run_blocks, stacked_blocks
from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.hidden_attention import KVProjection

# OPT's positional table starts with two rows that no token uses (a fairseq legacy of
# reserving ids for padding), so position p reads row p + 2; HF checkpoints keep that layout.
POSITION_OFFSET = 2

# Hugging Face's name of each module (`OPTForCausalLM`), by this module's attribute: blocks
# under `model.decoder.layers.{i}.`. The output projection is the tied `embed_tokens`.
HF_NAMES = {"embed": "model.decoder.embed_tokens", "positions": "model.decoder.embed_positions",
            "final_norm": "model.decoder.final_layer_norm"}
HF_LAYER_NAMES = {
    "attn_norm": "self_attn_layer_norm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj", "out_proj": "self_attn.out_proj", "mlp_norm": "final_layer_norm",
    "fc1": "fc1", "fc2": "fc2",
}
HF_LAYERS = "model.decoder.layers"

Affine = tuple[np.ndarray, np.ndarray]  # (kernel [in, out] or LayerNorm scale [D], bias)


@dataclass(frozen=True)
class OPTLayerWeights:
    """One decoder block as plain arrays, the form the dense oracle computes with."""

    attn_norm: Affine
    q_proj: Affine
    k_proj: Affine
    v_proj: Affine
    out_proj: Affine
    mlp_norm: Affine
    fc1: Affine
    fc2: Affine


@dataclass(frozen=True)
class OPTWeights:
    """All weights; `embed` is also the output projection, as OPT ties them."""

    embed: np.ndarray  # [V, D]
    positions: np.ndarray  # [max_position + POSITION_OFFSET, D]
    final_norm: Affine
    layers: tuple[OPTLayerWeights, ...]


def _linear(d_in: int, d_out: int, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, dtype=dtype, param_dtype=dtype, rngs=rngs)


def _layer_norm(cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # Two-pass variance, as torch's LayerNorm: OPT's residual stream has outlier features
    # whose large mean would cancel catastrophically in E[x^2] - E[x]^2.
    return nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.norm_eps, use_fast_variance=False,
                         dtype=dtype, param_dtype=dtype, rngs=rngs)


class OPTBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, f, width = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
        self.cfg = cfg
        self.attn_norm = _layer_norm(cfg, dtype, rngs)
        self.q_proj = _linear(d, width, dtype, rngs)
        self.k_proj = _linear(d, width, dtype, rngs)
        self.v_proj = _linear(d, width, dtype, rngs)
        self.out_proj = _linear(width, d, dtype, rngs)
        self.mlp_norm = _layer_norm(cfg, dtype, rngs)
        self.fc1 = _linear(d, f, dtype, rngs)
        self.fc2 = _linear(f, d, dtype, rngs)

    def __call__(
        self,
        x: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        meta: AttentionMetadata,
        attention: AttentionFn,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg, t = self.cfg, x.shape[0]
        h = self.attn_norm(x)
        q, k, v = (proj(h).reshape(t, cfg.num_heads, cfg.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        kp, vp = self.k_proj, self.v_proj
        proj = KVProjection(kp.kernel.get_value(), vp.kernel.get_value(), kp.bias.get_value(), vp.bias.get_value())
        o, k_pages, v_pages = attention(q, k, v, k_pages, v_pages, meta, scale=cfg.head_dim**-0.5,
                                        hidden=h, proj=proj)
        x = x + self.out_proj(o.reshape(t, cfg.num_heads * cfg.head_dim))
        x = x + self.fc2(jax.nn.relu(self.fc1(self.mlp_norm(x))))
        return x, k_pages, v_pages


class OPTForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        if cfg.num_kv_heads != cfg.num_heads or not cfg.tie_embeddings:
            raise ValueError(f"{cfg.name}: OPT has multi-head attention and tied embeddings")
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                               rngs=rngs)
        self.positions = nnx.Embed(cfg.max_position + POSITION_OFFSET, cfg.hidden_size,
                                   dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = stacked_blocks(lambda r: OPTBlock(cfg, dtype, r), cfg.num_layers, rngs)
        self.final_norm = _layer_norm(cfg, dtype, rngs)

    def __call__(
        self, token_ids: jax.Array, cache: KVCache, meta: AttentionMetadata, attention: AttentionFn
    ) -> tuple[jax.Array, KVCache]:
        """Final hidden states `[T, D]` of a flat ragged batch, and the updated cache."""
        x = self.embed(token_ids) + self.positions(meta.positions + POSITION_OFFSET)
        x, cache = run_blocks(self.layers, x, cache, meta, attention)
        return self.final_norm(x), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        return self.embed.attend(hidden).astype(jnp.float32)


def _affine_of(module: nnx.Linear | nnx.LayerNorm) -> Affine:
    weight = module.scale if isinstance(module, nnx.LayerNorm) else module.kernel
    return np.asarray(weight.get_value()), np.asarray(module.bias.get_value())


def opt_weights_of(model: OPTForCausalLM) -> OPTWeights:
    """The module's parameters as plain arrays, e.g. to run the dense oracle on random weights."""
    stacked = {f.name: _affine_of(getattr(model.layers, f.name)) for f in fields(OPTLayerWeights)}
    return OPTWeights(
        embed=np.asarray(model.embed.embedding.get_value()),
        positions=np.asarray(model.positions.embedding.get_value()),
        final_norm=_affine_of(model.final_norm),
        layers=tuple(OPTLayerWeights(**{name: (w[i], b[i]) for name, (w, b) in stacked.items()})
                     for i in range(model.cfg.num_layers)),
    )
