"""Llama-family decoder (RMSNorm, rotate-half RoPE, GQA, SwiGLU) on a paged KV cache.

The model never owns the cache: each call takes the pages of every layer and returns them
updated, so the runner can donate them to its jit step and XLA updates them in place.
Attention is injected (`AttentionFn`) so the runner picks the Pallas kernel or its jnp
reference without the model knowing.
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.models.config import ModelConfig
from jserve.models.gguf_loader import LlamaLayerWeights, LlamaWeights
from jserve.models.paged import AttentionFn, KVCache, run_blocks, stacked_blocks
from jserve.pallas_kernels.attention_metadata import AttentionMetadata
from jserve.pallas_kernels.hidden_attention import KVProjection
from jserve.pallas_kernels.rope import rope


def _linear(d_in: int, d_out: int, dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


# Hugging Face's name of each module (`LlamaForCausalLM`, and Mistral and Qwen2, which share
# its layout), by this module's attribute: blocks under `model.layers.{i}.`.
HF_NAMES = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
}
HF_LAYERS = "model.layers"


class LlamaBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        norm = dict(epsilon=cfg.norm_eps, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(d, **norm)
        self.wq = _linear(d, cfg.num_heads * hd, dtype, rngs, cfg.qkv_bias)
        self.wk = _linear(d, cfg.num_kv_heads * hd, dtype, rngs, cfg.qkv_bias)
        self.wv = _linear(d, cfg.num_kv_heads * hd, dtype, rngs, cfg.qkv_bias)
        self.wo = _linear(cfg.num_heads * hd, d, dtype, rngs)
        self.mlp_norm = nnx.RMSNorm(d, **norm)
        self.w_gate = _linear(d, cfg.intermediate_size, dtype, rngs)
        self.w_up = _linear(d, cfg.intermediate_size, dtype, rngs)
        self.w_down = _linear(cfg.intermediate_size, d, dtype, rngs)

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
        rotate = partial(rope, positions=meta.positions, theta=cfg.rope_theta, scaling=cfg.rope_scaling)
        q = rotate(self.wq(h).reshape(t, cfg.num_heads, cfg.head_dim))
        k = rotate(self.wk(h).reshape(t, cfg.num_kv_heads, cfg.head_dim))
        v = self.wv(h).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        wk, wv = self.wk, self.wv
        proj = KVProjection(wk.kernel.get_value(), wv.kernel.get_value(),
                            *((wk.bias.get_value(), wv.bias.get_value()) if cfg.qkv_bias else ()),
                            rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling)
        o, k_pages, v_pages = attention(q, k, v, k_pages, v_pages, meta, scale=cfg.head_dim**-0.5,
                                        hidden=h, proj=proj)
        x = x + self.wo(o.reshape(t, cfg.num_heads * cfg.head_dim))
        h = self.mlp_norm(x)
        x = x + self.w_down(jax.nn.silu(self.w_gate(h)) * self.w_up(h))
        return x, k_pages, v_pages


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                               rngs=rngs)
        self.layers = stacked_blocks(lambda r: LlamaBlock(cfg, dtype, r), cfg.num_layers, rngs)
        self.final_norm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.norm_eps, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_embeddings else _linear(cfg.hidden_size, cfg.vocab_size,
                                                               dtype, rngs)

    def __call__(
        self, token_ids: jax.Array, cache: KVCache, meta: AttentionMetadata, attention: AttentionFn
    ) -> tuple[jax.Array, KVCache]:
        """Final hidden states `[T, D]` of a flat ragged batch, and the updated cache."""
        x, cache = run_blocks(self.layers, self.embed(token_ids), cache, meta, attention)
        return self.final_norm(x), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return self.embed.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)


def _param(module: nnx.Module) -> nnx.Param:
    return module.scale if isinstance(module, nnx.RMSNorm) else module.kernel


def llama_weights_of(model: LlamaForCausalLM) -> LlamaWeights:
    """The module's parameters as plain arrays, e.g. to run the dense oracle on random weights."""
    stacked = {f.name: np.asarray(_param(getattr(model.layers, f.name)).get_value())
               for f in fields(LlamaLayerWeights)}
    return LlamaWeights(
        embed=np.asarray(model.embed.embedding.get_value()),
        final_norm=np.asarray(model.final_norm.scale.get_value()),
        lm_head=None if model.lm_head is None else np.asarray(model.lm_head.kernel.get_value()),
        layers=tuple(LlamaLayerWeights(**{name: a[i] for name, a in stacked.items()})
                     for i in range(model.cfg.num_layers)),
    )


def load_llama_weights(model: LlamaForCausalLM, weights: LlamaWeights) -> None:
    """Copy dequantized GGUF weights (already `[in, out]`) into the module's parameters."""
    dtype = model.embed.embedding.get_value().dtype
    model.embed.embedding.set_value(jnp.asarray(weights.embed, dtype))
    model.final_norm.scale.set_value(jnp.asarray(weights.final_norm, dtype))
    if model.lm_head is not None:
        if weights.lm_head is None:
            raise ValueError("checkpoint has tied embeddings but the config does not")
        model.lm_head.kernel.set_value(jnp.asarray(weights.lm_head, dtype))
    if len(weights.layers) != model.cfg.num_layers:
        raise ValueError(f"checkpoint has {len(weights.layers)} layers, the model {model.cfg.num_layers}")
    for f in fields(LlamaLayerWeights):
        value = jnp.asarray(np.stack([np.asarray(getattr(layer, f.name)) for layer in weights.layers]), dtype)
        param = _param(getattr(model.layers, f.name))
        if param.get_value().shape != value.shape:
            raise ValueError(f"{f.name}: checkpoint shape {value.shape[1:]} != model {param.get_value().shape[1:]}")
        param.set_value(value)
