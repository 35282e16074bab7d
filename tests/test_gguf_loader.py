"""Tests for models.gguf_loader and the dense reference forward pass built on it."""

from __future__ import annotations

import dataclasses

import pathlib

import gguf
import numpy as np
import pytest

from jserve.models.dense_reference import dense_greedy_generate, dense_logits
from jserve.models.config import ModelConfig
from jserve.models.registry import get_config
from jserve.models.gguf_loader import LlamaWeights, _unpermute_rope_rows, load_llama_gguf
from jserve.models.tokenizer import Tokenizer

Model = tuple[ModelConfig, LlamaWeights]


def test_smollm2_hparams_match_registry(smollm2_model: Model) -> None:
    """The GGUF metadata and the registry's hand-written shape must agree."""
    hparams, _ = smollm2_model
    assert hparams.norm_eps == pytest.approx(1e-5)
    assert dataclasses.replace(hparams, norm_eps=1e-5) == get_config("smollm2-135m")


def test_smollm2_weight_shapes(smollm2_model: Model) -> None:
    _, weights = smollm2_model
    d, v, f, q, kv = 576, 49152, 1536, 9 * 64, 3 * 64
    assert weights.embed.shape == (v, d)
    assert weights.final_norm.shape == (d,)
    assert weights.lm_head is None
    assert len(weights.layers) == 30
    expected = {
        "attn_norm": (d,),
        "wq": (d, q),
        "wk": (d, kv),
        "wv": (d, kv),
        "wo": (q, d),
        "mlp_norm": (d,),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
    }
    for layer in weights.layers:
        for name, shape in expected.items():
            array = getattr(layer, name)
            assert array.shape == shape, name
            assert array.dtype == np.float32, name
            assert np.isfinite(array).all(), name


@pytest.mark.parametrize("n_head", [9, 3])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    w = np.random.default_rng(0).standard_normal((n_head * 64, 40)).astype(np.float32)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(_unpermute_rope_rows(permuted, n_head), w)


def _write_gguf(path: pathlib.Path, arch: str, embed: np.ndarray) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(0)
    writer.add_context_length(16)
    writer.add_embedding_length(embed.shape[1])
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("output_norm.weight", np.ones(embed.shape[1], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_llama_file_loads(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.gguf"
    embed = np.arange(32, dtype=np.float32).reshape(4, 8)
    _write_gguf(path, "llama", embed)
    hparams, weights = load_llama_gguf(path)
    assert (hparams.vocab_size, hparams.hidden_size, hparams.head_dim) == (4, 8, 8)
    assert hparams.rope_theta == 10000.0 and hparams.tie_embeddings
    np.testing.assert_array_equal(weights.embed, embed)


def test_rejects_other_architectures(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "other.gguf"
    _write_gguf(path, "gpt2", np.zeros((4, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="gpt2"):
        load_llama_gguf(path)


def test_rejects_unsupported_tensor_types(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "int8.gguf"
    _write_gguf(path, "llama", np.zeros((4, 8), dtype=np.int8))
    with pytest.raises(ValueError, match="token_embd.weight.*I8"):
        load_llama_gguf(path)


def test_dense_greedy_answers_capital_of_france(
    smollm2_model: Model, smollm2_tokenizer: Tokenizer
) -> None:
    hparams, weights = smollm2_model
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    prompt_ids = smollm2_tokenizer.encode(prompt)
    generated = dense_greedy_generate(hparams, weights, prompt_ids, 12, hparams.eos_token_id)
    assert "Paris" in smollm2_tokenizer.decode(generated)

    logits = dense_logits(hparams, weights, np.asarray(prompt_ids))
    assert logits.shape == (len(prompt_ids), hparams.vocab_size)
    assert int(logits[-1].argmax()) == generated[0]
