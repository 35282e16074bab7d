"""The functional API for JAX users: docs/jax.md's example runs as written (a greedy step in
the caller's own jit, then `LLM` on the same parameters in memory, the ids compared there)."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np

from jserve.models import functional
from jserve.models.loading import LoadedModel

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
