"""Where the test suite's time goes: per test and per module, its wall time and JAX's
tracing, lowering and XLA compile seconds (issue 30 item 9). Measured, not guessed, before a
test is cut or moved to nightly.

It is a pytest plugin: each pytest process (each xdist worker) writes its tests' figures to
`$SUITE_PROFILE_DIR/<worker>.json`; run as a script, it sums them by module.

    SUITE_PROFILE_DIR=/tmp/prof PYTHONPATH=bench python -m pytest -q -p suite_compile_profile \\
        -m "not slow" -n 2
    python bench/suite_compile_profile.py /tmp/prof [--top 25]

Seconds are summed over tests, so under xdist they exceed the wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import time

EVENTS = {"/jax/core/compile/backend_compile_duration": "compile",
          "/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}

_seconds: collections.Counter[str] = collections.Counter()
_per_test: dict[str, dict[str, float]] = {}


def pytest_configure(config) -> None:  # noqa: ANN001 (pytest's hook)
    import jax

    def listen(event: str, duration: float, **_) -> None:
        if event in EVENTS:
            _seconds[EVENTS[event]] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)


def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201
    before, t0 = dict(_seconds), time.perf_counter()
    yield
    _per_test[item.nodeid] = {"wall": time.perf_counter() - t0,
                              **{k: _seconds[k] - before.get(k, 0.0) for k in EVENTS.values()}}


pytest_runtest_protocol.hookwrapper = True


def pytest_sessionfinish(session) -> None:  # noqa: ANN001
    out = pathlib.Path(os.environ.get("SUITE_PROFILE_DIR", "suite_profile"))
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"{worker}.json").write_text(json.dumps(_per_test, indent=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=pathlib.Path, help="$SUITE_PROFILE_DIR of the run")
    ap.add_argument("--top", type=int, default=25, help="modules to list")
    args = ap.parse_args()
    by_module: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for f in args.folder.glob("*.json"):
        for test, figures in json.loads(f.read_text()).items():
            by_module[test.split("::")[0]].update(figures)
    total = sum(by_module.values(), collections.Counter())
    print(f"{len(by_module)} modules: " + ", ".join(f"{k} {v:.0f} s" for k, v in total.items()))
    print(f"{'wall':>8} {'compile':>8} {'trace':>7} {'lower':>7}  module")
    for module, c in sorted(by_module.items(), key=lambda kv: -kv[1]["wall"])[:args.top]:
        print(f"{c['wall']:8.1f} {c['compile']:8.1f} {c['trace']:7.1f} {c['lower']:7.1f}  {module}")


if __name__ == "__main__":
    main()
