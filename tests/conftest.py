"""Session-wide fixtures: the default GGUF model is loaded once for all tests."""

from __future__ import annotations

import dataclasses
import os
import pathlib

# Compile tests' steps cheaply: compiling, not running, is most of what a CPU test of a small
# model spends, and each test builds engines of its own shapes. Without LLVM's optimisations
# (a tiny-llama preemption test: 16.1 s of its 17.2 s in XLA; 9.7 s at level 0), and with
# XLA:CPU's older elemental emitters for fusions instead of its fusion emitters and without
# LLVM's expensive passes (a tiny-llama step 1.12 s -> 0.36 s to compile, the sampler 1.17 s ->
# 0.33 s; the engine, kernel and server tests 289 s -> 193 s of pytest at -n 2). Every
# comparison in the suite runs its engine and its oracle in one process, so both see the same
# code; the golden files hold under these flags. Set before JAX starts its CPU backend.
CPU_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                      "--xla_llvm_disable_expensive_passes=true")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import pytest
from flax import nnx

from jserve.models.config import ModelConfig
from jserve.models.loading import MODEL_CLASSES, LoadedModel, load_model, load_tokenizer
from jserve.models.registry import get_config
from jserve.models.gguf_loader import LlamaWeights, gguf_path_for_default, load_llama_gguf
from jserve.models.tokenizer import Tokenizer



# A small engine for SmolLM2's vocabulary and chat-length prompts: test_paris's SmolLM2 (whose
# 30-layer steps take the longest to compile, so it builds one engine only) and the server
# tests' `tiny_smollm2_vocab`.
SMOL_ENGINE = {"num_blocks": 64, "max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 256}


def forced_cpu_devices_env(count: int) -> dict[str, str]:
    """The environment of a subprocess whose JAX sees `count` CPU devices (JAX fixes its
    devices at start-up), with the tests' compile flags."""
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={count} {CPU_TEST_XLA_FLAGS}"}


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


@pytest.fixture(scope="session")
def tiny_smollm2_vocab() -> LoadedModel:
    """SmolLM2's tokenizer over tiny-llama's two layers, with SmolLM2's vocabulary and special
    tokens (random weights): for text, chat and HTTP tests that need a real byte-level
    tokenizer and chat template but no real answer. Its steps compile in about a tenth of
    SmolLM2's 30 layers' (under load 0.5-0.9 s against 6-7 s a step)."""
    smol = get_config("smollm2-135m")
    cfg = dataclasses.replace(get_config("tiny-llama"), name="tiny-llama-smollm2-vocab",
                              vocab_size=smol.vocab_size, bos_token_id=smol.bos_token_id,
                              eos_token_id=smol.eos_token_id, tie_embeddings=smol.tie_embeddings)
    return LoadedModel.of(MODEL_CLASSES[cfg.family](cfg, rngs=nnx.Rngs(0)), load_tokenizer("smollm2-135m"))
