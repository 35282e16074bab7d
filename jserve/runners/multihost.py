"""Tensor parallelism across hosts: one engine loop on the coordinator, the step on every host.

JAX runs one controller per process: every process must issue the same computations over
the global mesh in the same order. The engine's decisions (policy, plan, bookkeeping) are
made once, on process 0; before each step it broadcasts the step's `Batch` to the other
processes (`multihost_utils.broadcast_one_to_all`, an XLA collective over the same devices),
and every process runs the same `JaxRunner.execute(batch)`: block swaps, layer moves and the
jit step, whose all-reduces then cross hosts. The others never get past building the
engine: they follow the coordinator's steps until it exits.

Every host runs the same command with `JAX_COORDINATOR_ADDRESS` (host:port of process 0),
`JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` set (or under a cluster manager `jax.distributed`
detects, such as SLURM), and `--tensor-parallel-size` the number of devices over all hosts.
Batches travel pickled: the hosts trust one another, as any JAX cluster's do.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jserve.engine.batch import Batch, StepOutput

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"


def initialize() -> bool:
    """Join the hosts' JAX cluster when `JAX_COORDINATOR_ADDRESS` is set (before anything
    touches a device); returns whether this process is one of several."""
    if not os.environ.get(COORDINATOR_ENV):
        return False
    if not jax.distributed.is_initialized():
        # CPU processes need a collectives library across processes; GPUs use NCCL anyway.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        num, pid = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
        jax.distributed.initialize(num_processes=int(num) if num else None,
                                   process_id=int(pid) if pid else None)
    return jax.process_count() > 1


def _broadcast(obj: Any) -> Any:
    """Process 0's `obj` on every process: its length, then its pickled bytes padded to a
    power of two (so the broadcast compiles once per size class)."""
    source = jax.process_index() == 0
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if source else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int32))[0])
    buf = np.zeros(1 << max(10, (n - 1).bit_length()), np.uint8)
    buf[: len(data)] = data
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n].tobytes())


class CoordinatorRunner:
    """Process 0's runner: each batch goes to the other processes, then runs here too; the
    rest of the runner (warm-up, buckets, host stores) is the wrapped one's."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        atexit.register(self.close)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def execute(self, batch: Batch) -> StepOutput:
        _broadcast(batch)
        return self.runner.execute(batch)

    def close(self) -> None:
        """Release the followers (once): they exit when told there are no more steps."""
        if self.runner is not None:
            _broadcast(None)
            self.runner = None


def follow(runner: Any) -> int:
    """Run the coordinator's steps on this process until it closes; returns how many."""
    steps = 0
    while (batch := _broadcast(None)) is not None:
        runner.execute(batch)
        steps += 1
    return steps


def coordinate(runner: Any, warmup: bool) -> Any:
    """`runner` as this process uses it: itself alone, wrapped on the coordinator of several;
    on the other processes, follow the coordinator's steps and exit."""
    if jax.process_count() == 1:
        return runner
    if jax.process_index() == 0:
        return CoordinatorRunner(runner)
    if warmup:
        runner.warmup()
    follow(runner)
    sys.exit(0)
