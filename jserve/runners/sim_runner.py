"""The simulator's runner: the same engine loop, with each step charged from a cost model
on a virtual clock instead of run on a device.

Token values do not matter in simulation: requests run with `ignore_eos`, and a replayed
trace ends each one at its recorded length through `benchmarking.replay.TraceEnds`, which
keeps that length out of the engine state (and so out of every policy's view).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jserve.engine.batch import Batch, RepeatedSteps, StepOutput
from jserve.engine.clock import VirtualClock
from jserve.runners.cost_model import CostModel, StepShape


class SimRunner:
    needs_inputs = False

    def __init__(self, cost_model: CostModel, clock: VirtualClock, token_id: int = 0,
                 pad: Callable[[int], int] | None = None, bytes_per_block: int = 0) -> None:
        """`pad`: the simulated runner's token bucketing (e.g. `Buckets.tokens` of the JAX
        runner whose profile the cost model was fitted to); None models no padding.
        `bytes_per_block`: K/V bytes of one block over all layers, what a swap moves."""
        self.cost_model = cost_model
        self.bytes_per_block = bytes_per_block
        self.clock = clock
        self.pad = pad
        self.token_id = token_id
        self.busy_time = 0.0

    def execute(self, batch: Batch) -> StepOutput:
        dt = self.cost_model.step_time(StepShape.of(batch, self.pad, self.bytes_per_block))
        self.clock.advance(dt)
        self.busy_time += dt
        n = batch.num_seqs
        return StepOutput(np.full(n, self.token_id, np.int32), np.zeros(n, np.float32))

    def repeat_decodes(self, batch: Batch, steps: int, until: float) -> RepeatedSteps:
        """Steps of `batch`'s decodes after the one just run, each priced as `execute`
        would price it, while they start before `until`."""
        shape = StepShape.of(batch, self.pad, self.bytes_per_block)
        times: list[float] = []
        for _ in range(steps):
            if self.clock.now() >= until:
                break
            shape = shape.one_token_on()
            dt = self.cost_model.step_time(shape)
            self.clock.advance(dt)
            self.busy_time += dt
            times.append(self.clock.now())
        k, n = len(times), batch.num_seqs
        return RepeatedSteps(tuple(times), np.full((k, n), self.token_id, np.int32),
                             np.zeros((k, n), np.float32))
