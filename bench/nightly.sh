#!/usr/bin/env bash
# The tests CI leaves out (marked `slow`: the HTTP load test, 500 streaming requests through
# `jserve serve`; SmolLM2 through its GGUF and its Hugging Face checkpoint; the golden
# decisions of the second seed's open traces; reproduce_tlru.py's stages), for a nightly job
# or before a release. Run from anywhere in the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -m slow "$@"
# jserve against Hugging Face transformers, live (needs torch and transformers, which CI does
# not install; CI compares with the golden file this script records).
python bench/hf_reference.py
