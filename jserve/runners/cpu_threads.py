"""XLA's CPU thread pools held to some of the machine's cores, so that the engine's host
thread has the others (`jserve serve` / `generate --xla-cpu-cores N`).

On a CPU the step the engine dispatches runs on XLA's threads while the host plans the next
one; with both on every core they slow each other. XLA sizes its pools by the cores the
process may use when its CPU backend starts, and its threads keep that affinity, so the
backend starts with the process held to N cores and the calling thread then gets them all
back. On two cores this took about a quarter off tiny-llama's engine step and added a
quarter to SmolLM2's, whose matmuls use the second core (bench/results/issue42_engine.md), so
it is off unless asked for, as vLLM's CPU backend reserves no core for one rank by default.
"""

from __future__ import annotations

import os

import jax

XLA_THREAD = "tf_XLAEigen"  # the name XLA:CPU gives its intra-op pool's threads


def xla_threads() -> list[int]:
    """Thread ids of XLA:CPU's intra-op pool in this process (none before its backend starts)."""
    return [int(t) for t in os.listdir("/proc/self/task")
            if _name(t) == XLA_THREAD]


def _name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # the thread ended meanwhile
        return ""


def start_xla_on(cores: int) -> None:
    """Start JAX's backend with XLA's CPU pools on this process's first `cores` CPUs, and
    leave the calling thread on all of them. Must run before anything starts the backend."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--xla-cpu-cores needs Linux (CPU affinity)")
    every = sorted(os.sched_getaffinity(0))
    if not 0 < cores < len(every):
        raise ValueError(f"--xla-cpu-cores must be between 1 and {len(every) - 1}: this process "
                         f"may use {len(every)} cores, and one at least is left to the host; got {cores}")
    if xla_threads():
        raise ValueError("--xla-cpu-cores must be chosen before JAX's CPU backend starts; it has "
                         "started in this process")
    os.sched_setaffinity(0, every[:cores])
    try:
        jax.devices()
    finally:
        os.sched_setaffinity(0, every)
