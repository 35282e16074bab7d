#!/usr/bin/env bash
# The tests CI leaves out (marked `slow`: the HTTP load test, 500 streaming requests through
# `jserve serve`; SmolLM2 through its GGUF and its Hugging Face checkpoint; SmolLM2 against the
# dense oracle, on the hidden cache, with layers offloaded and under LayerKV; the MHA models
# all hidden, their mixed runs on the jnp reference without a warm-up, and tiny-opt's mixed
# hidden-cache run on the interpreted kernels; tensor parallelism on tiny-llama-mha and
# tiny-opt; the golden decisions of the second seed's open traces; reproduce_tlru.py's
# stages; the sweep on a two-worker Ray cluster; the server's drain on SIGINT), for a nightly
# job or before a release. Each has a faster test in CI over the same
# property. Then guidellm and lm-evaluation-harness against `jserve serve`
# (bench/clients.sh). Run from anywhere in the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -m slow "$@"
# The property tests CI runs with a tenth of their examples (tests/property_examples.py), with
# all of them.
JSERVE_PROPERTY_EXAMPLES=full python -m pytest -q -m "not slow" "$@" \
  tests/test_policy_properties.py tests/test_vllm_policy_properties.py \
  tests/test_prefix_cache.py tests/test_hidden_cache_bookkeeping.py \
  tests/test_layer_residency.py tests/test_layerkv_policy.py
# jserve against Hugging Face transformers, live (needs torch and transformers, which CI does
# not install; CI compares with the golden file this script records).
python bench/hf_reference.py
# guidellm (synthetic prompts) and lm-eval (local-completions, batch size 8) against `jserve
# serve`, offline; a client that is not installed is skipped with a line saying so.
bash bench/clients.sh
