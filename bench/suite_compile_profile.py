"""Where the test suite's time goes: per test and per module, its wall time and JAX's
tracing, lowering and XLA compile seconds (issue 30 item 9). Measured, not guessed, before a
test is cut or moved to nightly.

It is a pytest plugin: each pytest process (each xdist worker) writes its tests' figures to
`$SUITE_PROFILE_DIR/<worker>.json`; run as a script, it sums them by module.

    SUITE_PROFILE_DIR=/tmp/prof PYTHONPATH=bench python -m pytest -q -p suite_compile_profile \\
        -m "not slow" -n 2
    python bench/suite_compile_profile.py /tmp/prof [--top 25]

Seconds are summed over tests, so under xdist they exceed the wall time. With `--programs` the
script also lists the compiled programs by name (JAX's function name, not its shapes): how
many times each was compiled and for how long, which shows the shapes that many tests build
apart, and what the persistent cache saved (its hits).
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

CACHE_HIT = "/jax/compilation_cache/cache_hits"

_seconds: collections.Counter[str] = collections.Counter()
_programs: list[tuple[str, float]] = []  # (function name, compile seconds) of the current test
_per_test: dict[str, dict[str, float]] = {}
_programs_per_test: dict[str, list[tuple[str, float]]] = {}


def pytest_configure(config) -> None:  # noqa: ANN001 (pytest's hook)
    import jax

    def listen(event: str, duration: float, fun_name: str = "?", **_) -> None:
        if event in EVENTS:
            _seconds[EVENTS[event]] += duration
            if EVENTS[event] == "compile":
                _programs.append((fun_name, duration))

    def count(event: str, **_) -> None:
        if event == CACHE_HIT:
            _seconds["cache hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.monitoring.register_event_listener(count)


def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201
    before, t0 = dict(_seconds), time.perf_counter()
    _programs.clear()
    yield
    _per_test[item.nodeid] = {"wall": time.perf_counter() - t0,
                              **{k: _seconds[k] - before.get(k, 0.0) for k in (*EVENTS.values(), "cache hits")}}
    _programs_per_test[item.nodeid] = list(_programs)


pytest_runtest_protocol.hookwrapper = True


def pytest_sessionfinish(session) -> None:  # noqa: ANN001
    out = pathlib.Path(os.environ.get("SUITE_PROFILE_DIR", "suite_profile"))
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"{worker}.json").write_text(json.dumps(_per_test, indent=0))
    (out / f"{worker}.programs").write_text(json.dumps(_programs_per_test, indent=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=pathlib.Path, help="$SUITE_PROFILE_DIR of the run")
    ap.add_argument("--top", type=int, default=25, help="modules (and programs) to list")
    ap.add_argument("--programs", action="store_true", help="also list the compiled programs by name")
    args = ap.parse_args()
    by_module: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for f in args.folder.glob("*.json"):
        for test, figures in json.loads(f.read_text()).items():
            by_module[test.split("::")[0]].update(figures)
    total = sum(by_module.values(), collections.Counter())
    print(f"{len(by_module)} modules: " + ", ".join(f"{k} {v:.0f} s" for k, v in total.items() if k != "cache hits")
          + f"; {total['cache hits']:.0f} persistent-cache hits")
    print(f"{'wall':>8} {'compile':>8} {'trace':>7} {'lower':>7}  module")
    for module, c in sorted(by_module.items(), key=lambda kv: -kv[1]["wall"])[:args.top]:
        print(f"{c['wall']:8.1f} {c['compile']:8.1f} {c['trace']:7.1f} {c['lower']:7.1f}  {module}")
    if args.programs:
        print_programs(args.folder, args.top)


def print_programs(folder: pathlib.Path, top: int) -> None:
    """Compiles by function name, the most seconds first, with the modules that compiled it."""
    seconds: collections.Counter[str] = collections.Counter()
    times: collections.Counter[str] = collections.Counter()
    modules: dict[str, set[str]] = collections.defaultdict(set)
    for f in folder.glob("*.programs"):
        for test, programs in json.loads(f.read_text()).items():
            for name, s in programs:
                seconds[name] += s
                times[name] += 1
                modules[name].add(test.split("::")[0].removeprefix("tests/"))
    print(f"\n{sum(times.values())} compiles of {len(times)} function names, {sum(seconds.values()):.0f} s")
    print(f"{'seconds':>8} {'times':>6}  program (modules)")
    for name, s in seconds.most_common(top):
        print(f"{s:8.1f} {times[name]:6d}  {name} ({', '.join(sorted(modules[name]))[:90]})")


if __name__ == "__main__":
    main()
