"""Hugging Face checkpoint directories: `config.json` to `ModelConfig`, safetensors weights
read tensor by tensor (slice by slice under tensor parallelism) into the model's layout, and
the way back (`save_checkpoint`), for weights made or fine-tuned in JAX.

Weights are read with the `safetensors` package through numpy (no torch): each parameter is
made with `jax.make_array_from_callback`, whose callback reads from the memory-mapped file
only the slice one device holds, transposed from torch's `[out, in]` to the model's
`[in, out]` and converted to the serving dtype. So no device, and no host buffer, ever holds
more than its share of a tensor; a host's peak is its devices' shards plus one slice.

Architectures: `LlamaForCausalLM` (GQA, Llama 3.1's RoPE scaling), `MistralForCausalLM`
(Llama's layout; a sliding window caps the context at the window, where it is exact),
`Qwen2ForCausalLM` (q/k/v biases) and `OPTForCausalLM` (pre-LayerNorm sizes). Anything
else, or an option the models do not implement, is refused by name in one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jserve.models import llama, opt
from jserve.models.config import Family, ModelConfig, repeated_kv_columns
from jserve.models.paged import is_stacked
from jserve.pallas_kernels.rope import Llama3RopeScaling

log = logging.getLogger(__name__)

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
INDEX = "model.safetensors.index.json"

# Architecture (config.json's `architectures[0]`) -> the family that runs it.
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
    "OPTForCausalLM": "opt",
}
_HF_NAMES = {"llama": (llama.HF_NAMES, llama.HF_LAYERS, llama.HF_LAYER_NAMES),
             "opt": (opt.HF_NAMES, opt.HF_LAYERS, opt.HF_LAYER_NAMES)}
# A parameter's name in a module (nnx) -> in a torch module, and whether it is a matrix
# stored `[out, in]`.
_PARAM_NAMES = {"kernel": ("weight", True), "bias": ("bias", False), "scale": ("weight", False),
                "embedding": ("weight", False)}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class CheckpointError(ValueError):
    """A checkpoint directory jserve cannot serve as it is (a file missing, an architecture
    or option not implemented, a tensor whose shape its config contradicts): the user's to
    fix, so the command line prints it as one line."""


def is_checkpoint_dir(model: str) -> bool:
    """Whether `--model` names a directory rather than a registry shape."""
    return pathlib.Path(model).expanduser().is_dir()


def _json(path: pathlib.Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path.parent}: no {path.name} (not a Hugging Face checkpoint "
                                  "directory)")
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _first(ids: Any) -> list[int]:
    """A token id or list of them (generation_config's EOS is often a list) as a list."""
    return [] if ids is None else [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _token_content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _eos_and_bos(path: pathlib.Path, config: dict[str, Any]) -> tuple[int, int]:
    """EOS and BOS from generation_config.json, else config.json. Where several EOS ids are
    listed (Llama 3.1 Instruct: end of text, end of message, end of turn), the one the
    tokenizer calls its EOS is kept if listed (what an instruct model ends a turn with, as
    vLLM takes it), else the first; the engine stops at one."""
    generation = _json(path / GENERATION_CONFIG)
    eos = _first(generation.get("eos_token_id", config.get("eos_token_id")))
    bos = _first(generation.get("bos_token_id", config.get("bos_token_id")))
    tokenizer = _json(path / TOKENIZER_CONFIG)
    named = _token_content(tokenizer.get("eos_token"))
    by_content = {_token_content(t): int(i) for i, t in tokenizer.get("added_tokens_decoder", {}).items()}
    tokenizer_eos = by_content.get(named)
    if tokenizer_eos is not None and (tokenizer_eos in eos or not eos):
        eos = [tokenizer_eos]
    if not eos:
        raise CheckpointError(f"{path}: no eos_token_id in {GENERATION_CONFIG} or {CONFIG}")
    if len(eos) > 1:
        log.info("%s lists EOS ids %s; the engine stops at %d (others: pass stop_token_ids)",
                 path.name, eos, eos[0])
    return eos[0], (bos[0] if bos else eos[0])


def _rope(path: pathlib.Path, c: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """RoPE base and scaling, in transformers 4's keys (`rope_theta`, `rope_scaling`) or 5's
    (`rope_parameters`)."""
    rope = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{path}: rope scaling {kind!r} is not supported (only Llama 3.1's "
                              "'llama3')")
    return theta, Llama3RopeScaling(
        float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]))


def _refuse(path: pathlib.Path, arch: str, c: dict[str, Any], key: str, allowed: object,
            default: object) -> None:
    value = c.get(key, default)
    if value != allowed:
        raise CheckpointError(f"{path}: {arch} with {key}={value!r} is not supported "
                              f"(jserve implements {key}={allowed!r})")


def _llama_config(path: pathlib.Path, arch: str, c: dict[str, Any]) -> dict[str, Any]:
    _refuse(path, arch, c, "hidden_act", "silu", "silu")
    _refuse(path, arch, c, "mlp_bias", False, False)
    _refuse(path, arch, c, "partial_rotary_factor", 1.0, 1.0)
    qwen2 = arch == "Qwen2ForCausalLM"
    if not qwen2:  # Llama's attention_bias also puts one on o_proj, which the model has not
        _refuse(path, arch, c, "attention_bias", False, False)
    heads = int(c["num_attention_heads"])
    context = int(c["max_position_embeddings"])
    window = c.get("sliding_window") if c.get("use_sliding_window", not qwen2) else None
    if window is not None and int(window) < context:
        log.info("%s: a sliding window of %d tokens; serving contexts up to it, where full "
                 "attention is the same", path.name, window)
        context = int(window)
    theta, scaling = _rope(path, c)
    return dict(
        family="llama", num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        intermediate_size=int(c["intermediate_size"]), max_position=context,
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), qkv_bias=qwen2,
    )


def _opt_config(path: pathlib.Path, arch: str, c: dict[str, Any]) -> dict[str, Any]:
    _refuse(path, arch, c, "do_layer_norm_before", True, True)
    _refuse(path, arch, c, "activation_function", "relu", "relu")
    _refuse(path, arch, c, "enable_bias", True, True)
    _refuse(path, arch, c, "layer_norm_elementwise_affine", True, True)
    _refuse(path, arch, c, "word_embed_proj_dim", c["hidden_size"], c["hidden_size"])
    heads = int(c["num_attention_heads"])
    return dict(
        family="opt", num_heads=heads, num_kv_heads=heads, head_dim=int(c["hidden_size"]) // heads,
        intermediate_size=int(c["ffn_dim"]), max_position=int(c["max_position_embeddings"]),
        norm_eps=1e-5, tie_embeddings=True,
    )


def read_config(path: str | pathlib.Path, name: str | None = None) -> ModelConfig:
    """The checkpoint's `ModelConfig`, named `name` (default: the directory's name, lower case)."""
    path = pathlib.Path(path).expanduser()
    c = _json(path / CONFIG, required=True)
    arch = (c.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported (supported: "
                              f"{', '.join(ARCHITECTURES)})")
    try:
        shape = (_llama_config if family == "llama" else _opt_config)(path, arch, c)
        eos, bos = _eos_and_bos(path, c)
        return ModelConfig(
            name=name or path.resolve().name.lower(), vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]), num_layers=int(c["num_hidden_layers"]),
            bos_token_id=bos, eos_token_id=eos, **shape)
    except KeyError as e:
        raise CheckpointError(f"{path / CONFIG}: {arch} needs {e.args[0]!r}") from None


def checkpoint_dtype(path: str | pathlib.Path) -> str | None:
    """The dtype config.json says the weights are in (`torch_dtype`, or transformers 5's
    `dtype`), if it is one jserve serves in."""
    c = _json(pathlib.Path(path).expanduser() / CONFIG)
    return _DTYPES.get(c.get("dtype") or c.get("torch_dtype"))


# --------------------------------------------------------------------------- weights


def _keys(path: tuple) -> list[str | int]:
    """A parameter's jax path as keys: `layers/wq/kernel` (the Variable's `value` dropped)."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return [k for k in keys if k is not None and k != "value"]


def hf_tensor_names(family: Family, path: tuple, num_layers: int) -> tuple[list[str], bool]:
    """The checkpoint tensors a parameter is read from (a block parameter's, one per layer in
    layer order), and whether they are stored transposed."""
    top, layers, layer_names = _HF_NAMES[family]
    *modules, param = _keys(path)
    hf_param, transposed = _PARAM_NAMES[param]
    if is_stacked(path):
        module = layer_names[modules[1]]
        return [f"{layers}.{i}.{module}.{hf_param}" for i in range(num_layers)], transposed
    return [f"{top[modules[0]]}.{hf_param}"], transposed


class _Tensors:
    """The checkpoint's tensors by name over its safetensors files (one, or shards listed in
    model.safetensors.index.json), each file memory-mapped once."""

    def __init__(self, path: pathlib.Path, files: contextlib.ExitStack) -> None:
        index = _json(path / INDEX)
        if index:
            names = index.get("weight_map", {})
            paths = sorted({path / f for f in names.values()})
        else:
            paths = sorted(path.glob("*.safetensors"))
        if not paths:
            found = ", ".join(sorted(p.name for p in path.glob("*.bin"))[:2])
            raise CheckpointError(f"{path}: no .safetensors weights" + (
                f" ({found} is torch's format, which jserve does not read: save the model "
                "with safe_serialization=True)" if found else ""))
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise CheckpointError(f"{path}: {INDEX} lists {missing[0]}, which is missing")
        self._files = [files.enter_context(safe_open(str(p), framework="np")) for p in paths]
        self._where = {name: f for f in self._files for name in f.keys()}

    def get(self, name: str, path: pathlib.Path) -> Any:
        """A lazy slice of tensor `name`; old OPT checkpoints name theirs without `model.`."""
        f = self._where.get(name) or self._where.get(name.removeprefix("model."))
        if f is None:
            raise CheckpointError(f"{path}: tensor {name!r} is missing from the weights")
        return f.get_slice(name if name in self._where else name.removeprefix("model."))


@dataclass(frozen=True)
class _Source:
    """One parameter as it is read: which stored slice a slice of the model's array is."""

    tensor: Any  # safetensors' lazy slice
    transposed: bool  # stored `[out, in]`, held `[in, out]`
    columns: np.ndarray | None  # held output column -> stored (KV heads repeated)
    dtype: np.dtype

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        """The model's `[index]` of this parameter, read from the file alone."""
        index = list(index)
        take = None
        if self.columns is not None:
            cols = self.columns[index[-1]]
            low = int(cols.min())
            index[-1], take = slice(low, int(cols.max()) + 1), cols - low
        x = self.tensor[tuple(reversed(index)) if self.transposed else tuple(index)]
        if self.transposed:
            x = x.T
        if take is not None:
            x = x[..., take]
        return np.ascontiguousarray(x, dtype=self.dtype)


@dataclass(frozen=True)
class _Layers:
    """A block parameter as it is read: one stored tensor per layer, stacked."""

    layers: list[_Source]

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        return np.stack([layer.read(index[1:]) for layer in self.layers[index[0]]])


def load_state(path: str | pathlib.Path, cfg: ModelConfig, held: ModelConfig,
               abstract: Any, sharding: Callable[[tuple], jax.sharding.Sharding],
               progress: bool = True) -> Any:
    """The model's state (`abstract`'s tree of shapes) read from the checkpoint at `path`:
    each parameter made on its devices by `sharding(path)` from the slices they hold.
    `held`: `cfg` as the model holds it (KV heads repeated for tensor parallelism)."""
    path = pathlib.Path(path).expanduser()
    columns = repeated_kv_columns(cfg, held) if held.num_kv_heads != cfg.num_kv_heads else None
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    bar = _progress(len(leaves), path.name) if progress else contextlib.nullcontext()
    with contextlib.ExitStack() as files, bar as tick:
        tensors = _Tensors(path, files)

        def load(param: tuple, leaf: jax.ShapeDtypeStruct) -> jax.Array:
            names, transposed = hf_tensor_names(cfg.family, param, cfg.num_layers)
            kv = columns is not None and _keys(param)[-2] in ("wk", "wv")
            shape = tuple(leaf.shape[1:] if is_stacked(param) else leaf.shape)
            if kv:
                shape = (*shape[:-1], cfg.num_kv_heads * cfg.head_dim)
            sources = []
            for name in names:
                tensor = tensors.get(name, path)
                stored = tuple(tensor.get_shape())
                if stored != (shape[::-1] if transposed else shape):
                    raise CheckpointError(f"{path}: tensor {name} has shape {list(stored)}, "
                                          f"config.json implies {list(shape[::-1] if transposed else shape)}")
                sources.append(_Source(tensor, transposed, columns if kv else None, np.dtype(leaf.dtype)))
            source = _Layers(sources) if is_stacked(param) else sources[0]
            array = jax.make_array_from_callback(leaf.shape, sharding(param), source.read)
            if tick is not None:
                tick.update(1)
            return array

        return jax.tree_util.tree_map_with_path(load, abstract)


@contextlib.contextmanager
def _progress(total: int, name: str) -> Iterator[Any]:
    from tqdm import tqdm

    with tqdm(total=total, desc=f"loading {name}", unit="tensor", leave=False) as bar:
        yield bar


# --------------------------------------------------------------------------- writing


def hf_architecture(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that computes what `cfg`'s family does."""
    if cfg.family == "opt":
        return "OPTForCausalLM"
    return "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """config.json for `cfg`, which `read_config` reads back to `cfg` (its name aside)."""
    common = dict(architectures=[hf_architecture(cfg)], vocab_size=cfg.vocab_size,
                  hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, max_position_embeddings=cfg.max_position,
                  bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                  tie_word_embeddings=cfg.tie_embeddings, torch_dtype=dtype)
    if cfg.family == "opt":
        return dict(common, model_type="opt", ffn_dim=cfg.intermediate_size,
                    do_layer_norm_before=True, activation_function="relu",
                    word_embed_proj_dim=cfg.hidden_size, enable_bias=True)
    rope = cfg.rope_scaling
    return dict(
        common, model_type="qwen2" if cfg.qkv_bias else "llama", hidden_act="silu",
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=None if rope is None else dict(
            rope_type="llama3", factor=rope.factor, low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position),
    )


def save_checkpoint(cfg: ModelConfig, state: Any, path: str | pathlib.Path,
                    max_shard_bytes: int = 4 * 2**30) -> None:
    """Write a model's state (`nnx.state(model)`, held as `cfg` says: no repeated KV heads)
    as a Hugging Face checkpoint directory: config.json and safetensors shards of at most
    `max_shard_bytes`, with their index when there are several; one shard is on the host at
    a time."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    dtype = str(np.dtype(leaves[0][1].dtype))
    (path / CONFIG).write_text(json.dumps(hf_config(cfg, _DTYPES.get(dtype, "float32")), indent=1))
    shards: list[list[tuple[tuple, Any]]] = [[]]
    size = 0
    for param, value in leaves:  # planned from sizes, so each shard is made only when written
        nbytes = value.size * np.dtype(value.dtype).itemsize
        if size and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((param, value))
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for file, shard in zip(files, shards):
        tensors = {}
        for param, value in shard:
            names, transposed = hf_tensor_names(cfg.family, param, cfg.num_layers)
            arrays = np.asarray(value) if is_stacked(param) else [np.asarray(value)]
            for name, array in zip(names, arrays, strict=True):
                tensors[name] = np.ascontiguousarray(array.T if transposed else array)
                weight_map[name] = file
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    if len(shards) > 1:
        (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
