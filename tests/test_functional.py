"""The functional API for JAX users: docs/jax.md's example runs as written (a greedy step in
the caller's own jit, then `LLM` on the same parameters in memory, the ids compared there)."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import pytest

from jserve.models import functional
from jserve.models.loading import LoadedModel
from jserve.models.registry import get_config

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "jax.md"


def test_docs_example_runs_and_matches_llm_generate() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 2
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(DOC), "exec"), namespace)  # the doc asserts the match
    assert len(namespace["generated"][0]) == 8


def test_split_and_bind_round_trip(tiny_loaded: LoadedModel) -> None:
    """A loaded model's params are the module's own arrays, and bind gives the module back."""
    model, params = functional.split(tiny_loaded.model, "reference")
    back = model.bind(params)
    assert back.cfg == tiny_loaded.config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(functional.split(back)[1]), strict=True):
        assert a is b or np.array_equal(a, b)


def test_a_config_and_params_make_the_same_module(tiny_loaded: LoadedModel) -> None:
    """`PagedModel.of(cfg)` is the structure alone; bound to a model's params it is that model."""
    model, params = functional.split(tiny_loaded.model)
    rebuilt = functional.PagedModel.of(tiny_loaded.config, attention=model.attention)
    assert rebuilt == model
    assert rebuilt.bind(params).cfg == tiny_loaded.config


def test_make_batch_names_out_of_vocabulary_ids() -> None:
    """Under jit an id past the vocabulary reads some embedding row silently; here it raises."""
    cfg = get_config("tiny-llama")
    cache = functional.KVCache.zeros(cfg, num_blocks=2, block_size=16, dtype=np.float32)
    with pytest.raises(ValueError, match=r"token ids \[-1, 512\] are outside the vocabulary \[0, 512\)"):
        functional.make_batch(cache, [[5, 512], [-1, 512]], [0, 0], [[0], [1]], max_len=16,
                              vocab_size=cfg.vocab_size)


def test_make_batch_pads_sequences_to_min_seqs() -> None:
    cfg = get_config("tiny-llama")
    cache = functional.KVCache.zeros(cfg, num_blocks=2, block_size=16, dtype=np.float32)
    pad = functional.make_batch(cache, [[5, 6]], [0], [[0]], max_len=16, vocab_size=cfg.vocab_size)
    exact = functional.make_batch(cache, [[5, 6]], [0], [[0]], max_len=16, vocab_size=cfg.vocab_size,
                                  min_tokens=2, min_seqs=1)
    assert (pad.sample_index.shape, pad.token_ids.shape) == ((8,), (8,))
    assert (exact.sample_index.shape, exact.token_ids.shape) == ((1,), (2,))
