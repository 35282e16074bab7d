"""Session-wide fixtures: the default GGUF model is loaded once for all tests."""

from __future__ import annotations

import pathlib

import jax
import pytest

from jserve.models.config import ModelConfig
from jserve.models.loading import LoadedModel, load_model
from jserve.models.gguf_loader import LlamaWeights, gguf_path_for_default, load_llama_gguf
from jserve.models.tokenizer import Tokenizer

if jax.default_backend() == "gpu":
    # XLA:GPU runs float32 matmuls as TF32 unless told otherwise; the jnp references and the
    # float32 engines are checked at float32 tolerances and exact greedy ids.
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> pathlib.Path:
    return gguf_path_for_default()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf_path: pathlib.Path) -> tuple[ModelConfig, LlamaWeights]:
    return load_llama_gguf(smollm2_gguf_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="session")
def smollm2_loaded() -> LoadedModel:
    """The default model with real weights, shared by every engine a test builds."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_loaded() -> LoadedModel:
    return load_model("tiny-llama", seed=0)
