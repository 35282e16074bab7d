"""Background warm-up (`background_compile`): the first buckets are built before `LLM(...)`
returns, the rest on threads of their own; steps meanwhile give the same tokens, and once the thread
ends every bucket a synchronous warm-up builds is built, each once."""

from __future__ import annotations

import threading

import jax
import numpy as np

from jserve import LLM, SamplingParams
from jserve.models.loading import LoadedModel
from jserve.runners.executables import Executables
from jserve.runners.jax_runner import first_shapes


def test_each_step_is_built_once_whichever_thread_asks_first() -> None:
    exes = Executables()
    started, release = threading.Event(), threading.Event()
    builds = []

    def slow_build():
        builds.append(1)
        started.set()
        release.wait(10)
        return "exe"

    exes.build_in_background([("a", slow_build), ("b", lambda: "exe-b")])
    started.wait(10)
    got = []
    waiter = threading.Thread(target=lambda: got.append(exes.get("a", slow_build)))
    waiter.start()
    assert exes.building_in_background and "a" not in exes
    release.set()
    waiter.join(10)
    exes.wait()
    assert got == [("exe", False)] and len(builds) == 1
    assert exes.get("b", lambda: "again") == ("exe-b", False)
    assert exes.get("c", lambda: "exe-c") == ("exe-c", True)
    assert not exes.building_in_background and set(exes) == {"a", "b", "c"}


def test_background_builds_run_on_as_many_threads_as_asked() -> None:
    """Two builds that each wait for the other finish only if they run at once."""
    exes = Executables()
    both = threading.Barrier(2, timeout=10)

    def build(name: str):
        both.wait()
        return name

    exes.build_in_background([(s, lambda s=s: build(s)) for s in "ab"], threads=2)
    exes.wait()
    assert sorted(exes) == ["a", "b"] and not both.broken


def test_first_shapes_are_the_buckets_of_a_short_prompt() -> None:
    assert first_shapes([16, 32, 64, 128, 256]) == [16, 32, 64]


def test_background_warm_up_serves_the_same_tokens_and_ends_with_every_bucket(
        tiny_loaded: LoadedModel) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in (5, 45, 100, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    options = dict(num_blocks=64, max_model_len=128, max_num_seqs=8)
    eager = LLM(tiny_loaded, warmup=True, **options)
    early = LLM(tiny_loaded, warmup=True, background_compile=True, **options)
    first = {s[0] for s in early.runner._executables}
    shapes = early.runner.buckets.shapes()
    wanted_first = set(first_shapes(shapes))
    assert first >= wanted_first and wanted_first < set(shapes)  # some left to the thread
    outs = early.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    want = eager.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    early.runner.wait_warmup()
    assert early.runner.warmed_up
    assert set(early.runner._executables) == set(eager.runner._executables)


def test_runners_of_one_model_share_its_compiled_steps(tiny_loaded: LoadedModel) -> None:
    """A second engine over the same model structure reuses the first's jitted step, so a
    bucket the first compiled costs the second no compile, and gives the same tokens."""
    options = dict(num_blocks=32, max_model_len=64, max_num_seqs=8, warmup=False)
    a, b = LLM(tiny_loaded, **options), LLM(tiny_loaded, **options)
    assert a.runner._step is b.runner._step
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = [[7, 99, 23, 5]]
    want = a.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    compiles = []

    def count(event: str, duration: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        got = b.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == [] and got[0].token_ids == want[0].token_ids
