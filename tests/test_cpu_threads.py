"""`--xla-cpu-cores`: XLA's CPU pools started on some cores, the calling thread left on all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jserve.runners.cpu_threads import start_xla_on

CORES = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores: one is left to the host")

CHILD = """
import json, os
import jax, jax.numpy as jnp
from jserve.runners.cpu_threads import start_xla_on, xla_threads
start_xla_on(1)
pools = [sorted(os.sched_getaffinity(t)) for t in xla_threads()]
print(json.dumps({"pools": pools, "main": sorted(os.sched_getaffinity(0)),
                  "sum": float(jax.jit(lambda x: (x * 2).sum())(jnp.ones(8)))}))
"""


@needs_two
def test_xla_pools_start_on_the_cores_asked_and_the_caller_keeps_all() -> None:
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["pools"] == [[CORES[0]]]  # one intra-op thread, on the first core
    assert out["main"] == CORES and out["sum"] == 16.0


@needs_two
def test_refused_once_the_backend_has_started() -> None:
    jax.devices()
    with pytest.raises(ValueError, match="before JAX's CPU backend starts"):
        start_xla_on(1)


def test_refuses_a_count_that_leaves_the_host_no_core() -> None:
    for cores in (0, len(CORES)):
        with pytest.raises(ValueError, match="--xla-cpu-cores must be between 1 and"):
            start_xla_on(cores)
