"""Hugging Face checkpoint directories (`--model PATH`): every architecture against
transformers (through its golden file), sharded loading over 4 forced CPU devices, the real
SmolLM2 weights through both loaders, the tokenizer, dtypes, and one-line errors."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jserve import LLM, SamplingParams
from jserve.builder import serving_dtype
from jserve.cli import main
from jserve.config import EngineConfig
from jserve.models.hf_checkpoint import CheckpointError, hf_config, read_config, save_checkpoint
from jserve.models.loading import LoadedModel, load_model
from jserve.models.registry import HF_REPOS, MODELS, get_config

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from conftest import forced_cpu_devices_env
from tiny_checkpoints import CONFIGS, GOLDEN, NEW_TOKENS, jserve_greedy, prompts, write_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Every tiny architecture on disk; Llama-GQA in two shards with their index."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: write_checkpoint(name, root / name, shards=2 if name == "llama-gqa" else 1)
            for name in CONFIGS}


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN))


def _ids(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY,
                                               use_tqdm=False)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_ids_and_logits_equal_transformers(checkpoints, golden, name: str) -> None:
    """jserve's step (`jserve.models.functional`, the engine's own) on the loaded weights:
    greedy ids identical to transformers', and the logits of every step within float32
    tolerance of its."""
    ids, logits = jserve_greedy(checkpoints[name], prompts())
    np.testing.assert_array_equal(ids, golden[f"{name}/ids"])
    np.testing.assert_allclose(logits, golden[f"{name}/logits"], atol=1e-4, rtol=1e-4)


def test_engine_serves_a_checkpoint_with_its_tokenizer(checkpoints, golden) -> None:
    """`LLM(PATH)` on the sharded Llama-GQA checkpoint: transformers' greedy ids through the
    engine, and text through the checkpoint's tokenizer and chat template."""
    llm = LLM(str(checkpoints["llama-gqa"]), num_blocks=64, warmup=False)
    assert _ids(llm) == golden["llama-gqa/ids"].tolist()
    tok = llm.tokenizer
    assert tok is not None and tok.encode("w5 w9 <s>") == [5, 9, 1]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2) and tok.is_special(2)
    assert tok.apply_chat_template([{"role": "user", "content": "w7"}]) == "<s>user w7 assistant"
    out = llm.chat([{"role": "user", "content": "w7 w8"}], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert 0 < len(out.token_ids) <= 4 and out.text == "".join(f"w{i}" for i in out.token_ids if i != 2)


def test_the_comparison_sees_rope_scaling(checkpoints, golden, tmp_path) -> None:
    """Without its Llama 3.1 scaling the same weights give other logits: the golden check of
    `llama3-rope` does test the scaled frequencies."""
    path = tmp_path / "unscaled"
    path.mkdir()
    for f in checkpoints["llama3-rope"].iterdir():
        (path / f.name).symlink_to(f)
    config = dict(CONFIGS["llama3-rope"], rope_scaling=None)
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps(config))
    _, logits = jserve_greedy(path, prompts(), new_tokens=1)
    assert np.abs(logits[:, 0] - golden["llama3-rope/logits"][:, 0]).max() > 1e-2


def test_sharded_loading_over_four_devices(checkpoints, golden) -> None:
    """Read straight onto a 4-device mesh (a subprocess: JAX fixes its device count at
    start): the same greedy ids, every split parameter in four equal shards, KV heads
    repeated to 4 where the checkpoint has 2, and no split tensor ever read whole."""
    names = ["qwen2", "opt"]  # GQA repeated to 4 KV heads, biases split with their columns; MHA
    run = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("checkpoint_sharding_checks.py")),
                          *(str(checkpoints[n]) for n in names)],
                         env=forced_cpu_devices_env(4), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for name in names:
        r = results[name]
        assert r["devices"] == 4 and r["ids"] == golden[f"{name}/ids"].tolist(), r
        assert r["split_params"] > 0 and r["not_split"] == [], r
        assert r["kv_heads"] == 4, r
        # A replicated tensor is read whole once (JAX reuses the read for every device), a
        # split one never whole.
        assert r["whole_reads"] == r["replicated_params"], r


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2_loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """SmolLM2's GGUF weights (dequantized) written as a Hugging Face checkpoint: float32
    safetensors in shards."""
    path = tmp_path_factory.mktemp("SmolLM2-135M-Instruct")
    save_checkpoint(smollm2_loaded.config, nnx.state(smollm2_loaded.model), path, max_shard_bytes=2**28)
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


def test_real_smollm2_weights_read_back_identical(smollm2_loaded: LoadedModel, smollm2_checkpoint) -> None:
    """The checkpoint reads back to the GGUF model's very arrays and shape (named as the
    registry's), so the engine computes the same; the slow test below runs both."""
    loaded = load_model(str(smollm2_checkpoint))
    assert loaded.config == smollm2_loaded.config
    for a, b in zip(jax.tree.leaves(nnx.state(smollm2_loaded.model)), jax.tree.leaves(nnx.state(loaded.model)),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_real_smollm2_same_greedy_ids_through_gguf_and_a_checkpoint(
        smollm2_loaded: LoadedModel, smollm2_checkpoint, smollm2_tokenizer) -> None:
    """Greedy ids of SmolLM2 from its GGUF and from its Hugging Face checkpoint, each through
    the engine (two 30-layer compiles: nightly)."""
    prompt = smollm2_tokenizer.encode(smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]))
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ids = [LLM(m, num_blocks=32, warmup=False).generate(prompt_token_ids=[prompt], sampling_params=params,
                                                        use_tqdm=False)[0].token_ids
           for m in (smollm2_loaded, str(smollm2_checkpoint))]
    assert ids[0] == ids[1] and "Paris" in smollm2_tokenizer.decode(ids[0])


def test_eos_from_generation_config_prefers_the_tokenizers_eos(checkpoints, tmp_path) -> None:
    """Llama 3.1 Instruct lists three EOS ids; the engine stops at the one its tokenizer
    calls EOS (end of turn), or else the first listed."""
    path = write_checkpoint("llama-gqa", tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9], "bos_token_id": 1}))
    assert read_config(path).eos_token_id == 2
    (path / "tokenizer_config.json").unlink()
    assert read_config(path).eos_token_id == 7


def test_dtype_converted_or_kept(checkpoints, tmp_path) -> None:
    """A bfloat16 checkpoint is served in float32 on CPU by default (converted exactly) and
    in bfloat16 when asked."""
    src = checkpoints["opt"]
    path = tmp_path / "bf16"
    path.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (path / f).write_bytes((src / f).read_bytes())
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, str(path / "model.safetensors"))
    config = EngineConfig(model=str(path))
    assert serving_dtype(config) == "float32"
    embed = tensors["model.decoder.embed_tokens.weight"]
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(str(path), dtype=np.dtype(dtype) if dtype == "float32" else jax.numpy.bfloat16)
        got = np.asarray(loaded.model.embed.embedding.get_value())
        assert got.dtype == np.dtype(dtype if dtype == "float32" else ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got.astype(np.float32), embed.astype(np.float32))


@pytest.mark.parametrize("name", [n for n in HF_REPOS if n in MODELS])
def test_named_shapes_are_their_checkpoints_configs(name: str, tmp_path) -> None:
    """A checkpoint with a named shape's config.json (as its Hugging Face repo has it) reads
    back to that shape and takes its name, so `--model PATH` runs a paper's benchmark as
    the named shape does."""
    cfg = MODELS[name]
    path = tmp_path / HF_REPOS[name].split("/")[1]  # as downloaded, e.g. vicuna-7b-v1.5
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config(cfg)))
    assert read_config(path) == dataclasses.replace(cfg, name=path.name.lower())
    assert get_config(str(path)) == cfg


def _write_config(path: pathlib.Path, **changes) -> pathlib.Path:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


def test_errors_are_one_line(checkpoints, tmp_path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(empty)
    gpt2 = write_checkpoint("opt", tmp_path / "gpt2")
    _write_config(gpt2, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="architecture 'GPT2LMHeadModel' is not supported"):
        read_config(gpt2)
    yarn = _write_config(write_checkpoint("llama-gqa", tmp_path / "yarn"), rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope scaling 'yarn'"):
        read_config(yarn)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((checkpoints["opt"] / "config.json").read_bytes())
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no .safetensors weights.*pytorch_model.bin"):
        load_model(str(no_weights))
    wrong = _write_config(write_checkpoint("llama-gqa", tmp_path / "wrong"), intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"mlp.down_proj.weight has shape \[64, 128\], config.json "
                                              r"implies \[64, 96\]"):
        load_model(str(wrong))
    for path, says in ((wrong, "implies"), (gpt2, "GPT2LMHeadModel"), (tmp_path / "nowhere", "not a directory")):
        assert main(["generate", "w5", "--model", str(path), "--raw"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and says in err[-1] and "Traceback" not in "".join(err)
