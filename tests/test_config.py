"""`EngineConfig`: validated once with clear errors, and filled the same way from every
command's options (declared once, so each `--help` lists them all)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from jserve.cache.prefix import PrefixCacheConfig
from jserve.cli import build_parser, main
from jserve.config import EngineConfig, add_engine_args, engine_config_from_args
from jserve.engine.view import SchedulerLimits


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_defaults_resolve_for_the_model() -> None:
    assert EngineConfig().limits == SchedulerLimits(256, 2048, 2048)  # smollm2: 8k context, capped
    assert EngineConfig(model="tiny-llama").limits.max_model_len == 1024  # its whole context
    cfg = EngineConfig(model="tiny-llama", max_model_len=64, max_num_seqs=4)
    assert cfg.limits == SchedulerLimits(4, 2048, 64)
    assert cfg.model_name == "tiny-llama" and cfg.policy_name == "vllm"


@pytest.mark.parametrize(("options", "message"), [
    ({"model": "gpt-17"}, "unknown model 'gpt-17'; known models: .*tiny-llama"),
    ({"policy": "fifo"}, "unknown policy 'fifo'; known policies: apt-serve, .*cacheopt, .*vllm"),
    ({"runner": "gpu"}, "runner must be one of 'real', 'sim', not 'gpu'"),
    ({"weights": "fp8"}, "weights must be one of 'auto', 'real', 'dummy', not 'fp8'"),
    ({"dtype": "int4"}, "dtype must be one of 'auto', .*, not 'int4'"),
    ({"attention": "flash"}, "attention must be one of .*'pallas-interpret', not 'flash'"),
    ({"hardware": "tpu-v9"}, "hardware must be one of .*'h100'.*, not 'tpu-v9'"),
    ({"block_size": 0}, "block_size must be an int >= 1, got 0"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an int >= 1, got 0"),
    ({"num_blocks": 0}, "num_blocks must be an int >= 1, got 0"),
    ({"max_model_len": -1}, "max_model_len must be an int >= 1, got -1"),
    ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens must be an int >= 1, got 2.5"),
    ({"swap_space": -1.0}, "swap_space must be >= 0 GiB, got -1.0"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
    ({"predictor": "shipped"}, "predictor shipped is not a directory `jserve train-predictor` wrote"),
    ({"prefix_cache": "fifo"}, "unknown prefix-cache eviction rule 'fifo'; known rules: .*tlru"),
    ({"runner": "sim", "model": object()}, "the simulator takes a model name"),
])
def test_bad_values_are_refused_with_the_reason(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_a_rule_name_is_shorthand_for_its_prefix_cache() -> None:
    assert EngineConfig(prefix_cache="tlru").prefix_cache == PrefixCacheConfig("tlru")
    assert EngineConfig(prefix_cache="none").prefix_cache is None


def test_every_option_maps_onto_its_field(tmp_path) -> None:
    args = parse("serve", "--model", "tiny-llama", "--weights", "dummy", "--dtype", "float32",
                 "--policy", "sarathi", "--max-model-len", "128", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "256", "--block-size", "8", "--num-blocks", "64",
                 "--gpu-memory-utilization", "0.5", "--swap-space", "1", "--prefix-cache", "tlru",
                 "--cache-capacity", "100", "--cache-isolation", "--tel-threshold", "0.1",
                 "--host-cache-capacity", "64", "--attention", "reference", "--no-warmup",
                 "--hardware", "h100", "--profile", "p.json")
    assert engine_config_from_args(args) == EngineConfig(
        model="tiny-llama", weights="dummy", dtype="float32", policy="sarathi", max_model_len=128,
        max_num_seqs=4, max_num_batched_tokens=256, block_size=8, num_blocks=64,
        gpu_memory_utilization=0.5, swap_space=1.0, runner="real", attention="reference",
        warmup=False, background_compile=True, hardware="h100", profile="p.json",
        prefix_cache=PrefixCacheConfig("tlru", 100, True, 0.1, 64))
    assert not engine_config_from_args(parse("serve", "--no-background-compile")).background_compile
    assert not engine_config_from_args(parse("serve", "--no-async-scheduling")).async_scheduling


def test_option_defaults_are_the_config_defaults() -> None:
    # the server compiles in the background by default, so it answers early
    assert engine_config_from_args(parse("serve")) == EngineConfig(background_compile=True)
    assert engine_config_from_args(parse("generate", "hi")) == EngineConfig(warmup=False)
    assert engine_config_from_args(parse("bench")) == EngineConfig(runner="sim")
    assert engine_config_from_args(parse("bench", "--engine", "real")) == EngineConfig()
    # bench's old name for the length cap still works
    assert parse("bench", "--max-total-len", "512").max_model_len == 512
    assert engine_config_from_args(parse("sweep", "--rates", "1")).policy == "vllm"


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "sweep"])
def test_each_help_lists_every_engine_option(command: str, capsys) -> None:
    declared = argparse.ArgumentParser()
    add_engine_args(declared, benchmark=command in ("bench", "sweep"), policy=command != "sweep")
    options = {s for a in declared._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert [o for o in sorted(options) if o not in text] == []
    assert ("--engine" in options) == (command in ("bench", "sweep"))


def test_configs_are_values() -> None:
    cfg = EngineConfig(model="tiny-llama")
    assert dataclasses.replace(cfg, policy="s3").policy == "s3" and cfg.policy == "vllm"
    assert EngineConfig(prefix_cache="lru").to_dict()["prefix_cache"] == {
        "eviction": "lru", "capacity_tokens": None, "isolation": False, "tel_threshold": 0.2,
        "host_capacity_tokens": 0, "q_hat": 100.0, "xi_tokens": None, "xi_fit": "offline",
        "prefill_seconds_per_token": None, "capacity_counts": "unreferenced", "history_threshold": 1024,
        "threshold_soft": False}
