"""Dense, cache-free Llama and OPT forward passes used as correctness oracles.

Everything is recomputed from scratch for the full sequence, in float32, with
no paging or KV cache, so that the optimized engine can be checked against an
implementation simple enough to verify by reading.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jserve.models.config import ModelConfig
from jserve.models.gguf_loader import LlamaWeights
from jserve.models.opt import POSITION_OFFSET, OPTWeights

# Sequences are padded up to a multiple of this so the jitted forward pass is
# compiled once per bucket instead of once per token.
_PAD_MULTIPLE = 64

Params = dict[str, Any]


Weights = LlamaWeights | OPTWeights


def _to_params(weights: Weights) -> Params:
    """Device-resident pytree of the weights (the weight dataclasses are not pytrees)."""
    params = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)}
    params["layers"] = [
        {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}
        for layer in weights.layers
    ]
    tied = isinstance(weights, OPTWeights) or weights.lm_head is None
    params["lm_head"] = weights.embed.T if tied else weights.lm_head
    return jax.tree.map(jnp.asarray, params)


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """HF rotate-half RoPE on x of shape [T, heads, head_dim]."""
    head_dim = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = positions[:, None].astype(jnp.float32) * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return x * jnp.cos(angles) + _rotate_half(x) * jnp.sin(angles)


def _layer_norm(x: jax.Array, scale_bias: tuple[jax.Array, jax.Array], eps: float) -> jax.Array:
    scale, bias = scale_bias
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def _affine(x: jax.Array, kernel_bias: tuple[jax.Array, jax.Array]) -> jax.Array:
    kernel, bias = kernel_bias
    return x @ kernel + bias


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax(q k^T / sqrt(d)) v over `[T, heads, d]` inputs, flattened to `[T, heads * d]`."""
    seq, num_heads, head_dim = q.shape
    # GQA: query head h reads KV head h // group, as in HF's repeat_kv.
    group = num_heads // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(head_dim)
    positions = jnp.arange(seq)
    causal = positions[:, None] >= positions[None, :]
    scores = jnp.where(causal[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("hqk,khd->qhd", probs, v).reshape(seq, num_heads * head_dim)


def _llama_attention(hp: ModelConfig, layer: Params, x: jax.Array) -> jax.Array:
    seq = x.shape[0]
    positions = jnp.arange(seq)
    q = (x @ layer["wq"]).reshape(seq, hp.num_heads, hp.head_dim)
    k = (x @ layer["wk"]).reshape(seq, hp.num_kv_heads, hp.head_dim)
    v = (x @ layer["wv"]).reshape(seq, hp.num_kv_heads, hp.head_dim)
    q = _rope(q, positions, hp.rope_theta)
    k = _rope(k, positions, hp.rope_theta)
    return _causal_attention(q, k, v) @ layer["wo"]


def _mlp(layer: Params, x: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"]


def _llama_hidden_states(hp: ModelConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    x = params["embed"][token_ids]
    for layer in params["layers"]:
        x = x + _llama_attention(hp, layer, _rms_norm(x, layer["attn_norm"], hp.norm_eps))
        x = x + _mlp(layer, _rms_norm(x, layer["mlp_norm"], hp.norm_eps))
    return _rms_norm(x, params["final_norm"], hp.norm_eps)


def _opt_hidden_states(hp: ModelConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    """HF OPT with `do_layer_norm_before=True`: learned positions, pre-LayerNorm, ReLU."""
    seq = token_ids.shape[0]
    x = params["embed"][token_ids] + params["positions"][jnp.arange(seq) + POSITION_OFFSET]
    for layer in params["layers"]:
        h = _layer_norm(x, layer["attn_norm"], hp.norm_eps)
        q, k, v = (_affine(h, layer[name]).reshape(seq, hp.num_heads, hp.head_dim)
                   for name in ("q_proj", "k_proj", "v_proj"))
        x = x + _affine(_causal_attention(q, k, v), layer["out_proj"])
        h = _layer_norm(x, layer["mlp_norm"], hp.norm_eps)
        x = x + _affine(jax.nn.relu(_affine(h, layer["fc1"])), layer["fc2"])
    return _layer_norm(x, params["final_norm"], hp.norm_eps)


def _hidden_states(hp: ModelConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    """Final-normed hidden states [T, D] for a full causal sequence."""
    family = {"llama": _llama_hidden_states, "opt": _opt_hidden_states}[hp.family]
    return family(hp, params, token_ids)


@functools.partial(jax.jit, static_argnums=0)
def _all_logits(hp: ModelConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    return _hidden_states(hp, params, token_ids) @ params["lm_head"]


@functools.partial(jax.jit, static_argnums=0)
def _next_token(
    hp: ModelConfig, params: Params, token_ids: jax.Array, length: jax.Array
) -> jax.Array:
    """Greedy token after the first `length` ids; causality makes padding beyond them inert."""
    hidden = _hidden_states(hp, params, token_ids)[length - 1]
    return jnp.argmax(hidden @ params["lm_head"])


def _padded(token_ids: list[int] | np.ndarray) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int32)
    size = -(-len(ids) // _PAD_MULTIPLE) * _PAD_MULTIPLE
    return np.pad(ids, (0, size - len(ids)))


def dense_logits(hparams: ModelConfig, weights: Weights, token_ids: np.ndarray) -> np.ndarray:
    """Float32 logits [T, V] for every position of `token_ids` [T]."""
    token_ids = np.asarray(token_ids)
    logits = _all_logits(hparams, _to_params(weights), jnp.asarray(_padded(token_ids)))
    return np.asarray(logits[: len(token_ids)])


def dense_greedy_generate(
    hparams: ModelConfig,
    weights: Weights,
    prompt_ids: list[int] | np.ndarray,
    max_new_tokens: int,
    eos_token_id: int | None,
) -> list[int]:
    """Greedy continuation of `prompt_ids`, including the EOS token if one is produced."""
    params = _to_params(weights)
    sequence = [int(t) for t in prompt_ids]
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(_next_token(hparams, params, jnp.asarray(_padded(sequence)), len(sequence)))
        generated.append(token)
        sequence.append(token)
        if token == eos_token_id:
            break
    return generated
