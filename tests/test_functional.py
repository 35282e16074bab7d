"""The functional API for JAX users. docs/jax.md's code blocks all run, in order, as one
program (a greedy loop in the caller's jit, a `lax.scan` decode, an optax step, `LLM` on the
same parameters, each asserting its ids match), and `make_batch`'s checks and padding."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from jserve.models import functional
from jserve.models.loading import LoadedModel
from jserve.models.registry import get_config

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "jax.md"


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """Each fenced block of a Markdown page: its language, the line its code starts on (0-based)
    and its code."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append((lines[i][3:].strip(), i + 1, "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def test_every_docs_block_runs() -> None:
    """Every block is Python (a block in another language would be left out of this test), and
    they run in order in one namespace, as a reader pastes them; tracebacks name the page's lines."""
    blocks = code_blocks(DOC.read_text())
    assert [language for language, _, _ in blocks] == ["python"] * len(blocks)
    assert len(blocks) >= 3
    namespace: dict = {}
    for _, first_line, code in blocks:
        exec(compile("\n" * first_line + code, str(DOC), "exec"), namespace)
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


@pytest.mark.parametrize("batch", [1, 3])
def test_a_decode_step_never_copies_the_pool(batch: int) -> None:
    """The layer loop carries every layer's pages; a step that copied them would pay the
    whole cache every layer (a one-token write once did: XLA read the written row back
    through the pool's old value). The compiled step holds no copy of a pool-sized array."""
    cfg = get_config("tiny-llama")
    model, params = functional.init(cfg, attention="reference")
    cache = functional.KVCache.zeros(cfg, num_blocks=4 * batch, block_size=16, dtype=np.float32)
    tables = jax.numpy.arange(4 * batch, dtype=np.int32).reshape(batch, 4)

    def step(params, cache, tokens):
        b = functional.decode_batch(tokens, jax.numpy.full(batch, 20, np.int32), tables, block_size=16)
        return model(params, cache, b)

    hlo = jax.jit(step, donate_argnums=1).lower(params, cache, np.ones(batch, np.int32)).compile().as_text()
    pool_rows = cache.k.shape[0] * cache.k.shape[1] * cache.k.shape[2]  # blocks * block_size, seen flat
    copies = [line for line in hlo.splitlines() if " copy(" in line
              and (f"[{cache.k.shape[0] * cache.k.shape[1]}," in line or f"[{pool_rows}," in line)]
    assert copies == [], copies
