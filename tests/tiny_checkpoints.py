"""Tiny random Hugging Face checkpoints of every architecture jserve loads, written with numpy
and safetensors alone, deterministically, in Hugging Face's own names and `[out, in]`
layout (from this file's tables, not jserve's, so a naming or layout slip in the loader
shows up as a mismatch against transformers).

`tests/test_hf_checkpoint.py` loads them with jserve and compares with
`tests/data/hf_golden.npz`, which `bench/hf_reference.py --record` makes by running the same
checkpoints through Hugging Face transformers (torch, which CI does not install);
`bench/hf_reference.py` alone compares live (nightly).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
from safetensors.numpy import save_file

GOLDEN = pathlib.Path(__file__).with_name("data") / "hf_golden.npz"
VOCAB, HIDDEN, FFN, LAYERS, CONTEXT = 256, 64, 128, 2, 256
NEW_TOKENS = 8

_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
               num_attention_heads=4, max_position_embeddings=CONTEXT, bos_token_id=1,
               eos_token_id=2, torch_dtype="float32")
_LLAMA = dict(_COMMON, intermediate_size=FFN, hidden_act="silu", rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False)

# name -> config.json. Each covers something of its own: GQA, Llama 3.1's RoPE scaling (an
# original context of 32 tokens puts every head_dim-16 frequency band in play) with tied
# embeddings, multi-query attention, Qwen2's q/k/v biases, OPT's learned positions.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa": dict(_LLAMA, architectures=["LlamaForCausalLM"], model_type="llama",
                      num_key_value_heads=2),
    "llama3-rope": dict(_LLAMA, architectures=["LlamaForCausalLM"], model_type="llama",
                        num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=True,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=32)),
    "mistral": dict(_LLAMA, architectures=["MistralForCausalLM"], model_type="mistral",
                    num_key_value_heads=1, sliding_window=None),
    "qwen2": dict(_LLAMA, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=False,
                  rms_norm_eps=1e-6),
    "opt": dict(_COMMON, architectures=["OPTForCausalLM"], model_type="opt", ffn_dim=FFN,
                do_layer_norm_before=True, activation_function="relu", word_embed_proj_dim=HIDDEN,
                enable_bias=True, bos_token_id=2, pad_token_id=1),
}


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in (7, 13)]


def _tensors(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every tensor of checkpoint `name`, by its Hugging Face name, torch's layout."""
    c = CONFIGS[name]
    d, f, heads = HIDDEN, FFN, c["num_attention_heads"]
    hd = d // heads
    kv = c.get("num_key_value_heads", heads) * hd

    def matrix(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def vector(n: int, around: float) -> np.ndarray:
        return (around + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    if c["model_type"] == "opt":
        p = "model.decoder."
        t[p + "embed_tokens.weight"] = rng.standard_normal((VOCAB, d)).astype(np.float32)
        t[p + "embed_positions.weight"] = (0.5 * rng.standard_normal((CONTEXT + 2, d))).astype(np.float32)
        for i in range(LAYERS):
            lp = f"{p}layers.{i}."
            for proj, (out, inp) in {"self_attn.q_proj": (d, d), "self_attn.k_proj": (d, d),
                                     "self_attn.v_proj": (d, d), "self_attn.out_proj": (d, d),
                                     "fc1": (f, d), "fc2": (d, f)}.items():
                t[lp + proj + ".weight"] = matrix(out, inp)
                t[lp + proj + ".bias"] = vector(out, 0.0)
            for norm in ("self_attn_layer_norm", "final_layer_norm"):
                t[lp + norm + ".weight"], t[lp + norm + ".bias"] = vector(d, 1.0), vector(d, 0.0)
        t[p + "final_layer_norm.weight"], t[p + "final_layer_norm.bias"] = vector(d, 1.0), vector(d, 0.0)
        return t
    t["model.embed_tokens.weight"] = rng.standard_normal((VOCAB, d)).astype(np.float32)
    for i in range(LAYERS):
        lp = f"model.layers.{i}."
        for proj, out in (("q_proj", d), ("k_proj", kv), ("v_proj", kv)):
            t[lp + f"self_attn.{proj}.weight"] = matrix(out, d)
            if c["model_type"] == "qwen2":
                t[lp + f"self_attn.{proj}.bias"] = vector(out, 0.0)
        t[lp + "self_attn.o_proj.weight"] = matrix(d, d)
        t[lp + "mlp.gate_proj.weight"] = matrix(f, d)
        t[lp + "mlp.up_proj.weight"] = matrix(f, d)
        t[lp + "mlp.down_proj.weight"] = matrix(d, f)
        t[lp + "input_layernorm.weight"] = vector(d, 1.0)
        t[lp + "post_attention_layernorm.weight"] = vector(d, 1.0)
    t["model.norm.weight"] = vector(d, 1.0)
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = matrix(VOCAB, d)
    return t


def _tokenizer_files(path: pathlib.Path) -> None:
    """A word-level tokenizer over the checkpoint's vocabulary (`w3 w17 ...`), with a chat
    template, for the loader's tokenizer path."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(3, VOCAB)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token="<s>", eos_token="</s>",
        added_tokens_decoder={str(i): dict(content=s, special=True) for i, s in enumerate(specials)},
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                      "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")))


def write_checkpoint(name: str, path: pathlib.Path, shards: int = 1) -> pathlib.Path:
    """Checkpoint `name` in `path` (config.json, tokenizer, safetensors in `shards` files with
    their index when more than one); the same bytes every time."""
    path.mkdir(parents=True, exist_ok=True)
    seed = sorted(CONFIGS).index(name)
    tensors = _tensors(name, np.random.default_rng(seed))
    (path / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    (path / "generation_config.json").write_text(json.dumps(dict(
        bos_token_id=CONFIGS[name]["bos_token_id"], eos_token_id=CONFIGS[name]["eos_token_id"])))
    _tokenizer_files(path)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: files[i * shards // len(names)] for i, n in enumerate(names)}
    for file in files:
        save_file({n: tensors[n] for n in names if weight_map[n] == file}, str(path / file),
                  metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(dict(metadata={}, weight_map=weight_map)))
    return path


def jserve_greedy(path: pathlib.Path, ps: list[list[int]], new_tokens: int = NEW_TOKENS
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Greedy ids `[prompts, new_tokens]` and the logits that chose each `[.., .., V]`, from
    jserve's loader and its functional step (the engine's own), prompts batched together."""
    import jax

    from jserve.models import functional
    from jserve.models.loading import load_model

    loaded = load_model(str(path))
    model, params = functional.split(loaded.model, "reference")
    max_len, block = 64, 16
    cache = functional.KVCache.zeros(loaded.model.cfg, len(ps) * max_len // block, block, np.float32)
    tables = [list(range(i * max_len // block, (i + 1) * max_len // block)) for i in range(len(ps))]
    step = jax.jit(model, donate_argnums=1)
    # Every step in the prompts' shape: one compile.
    pad = functional.pow2_at_least(sum(map(len, ps)), 8)
    vocab = loaded.model.cfg.vocab_size
    batch = functional.make_batch(cache, ps, [0] * len(ps), tables, max_len=max_len, vocab_size=vocab,
                                  min_tokens=pad)
    ids, logits = [], []
    for s in range(new_tokens):
        out, cache = step(params, cache, batch)
        out = np.asarray(out)[: len(ps)]
        logits.append(out)
        ids.append(out.argmax(-1))
        batch = functional.make_batch(cache, [[int(t)] for t in ids[-1]],
                                      [len(p) + s for p in ps], tables, max_len=max_len,
                                      vocab_size=vocab, min_tokens=pad)
    return np.stack(ids, 1), np.stack(logits, 1)
