#!/usr/bin/env bash
# The tests CI leaves out (marked `slow`: the HTTP load test, 500 streaming requests through
# `jserve serve`), for a nightly job or before a release. Run from anywhere in the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -m slow "$@"
