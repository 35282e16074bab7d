"""What a serving stack spends on a step beside the GPU's work: engine-overhead profiles.

A simulated step costs two separate parts. The GPU's work depends on the model's shape, the
GPU and the tensor-parallel degree (`cost_model.RooflineCostModel`, `measured_cost`). The
serving stack's own time depends on which system, which version and which mode runs it:
Python scheduling and output processing per step and per sequence, driving the workers of
a tensor-parallel group, and whether the kernels of a step are launched one by one (eager)
or replayed from a CUDA graph. One stack's figures are an `EngineOverhead` with a name and
its source; the shipped ones are fitted by `bench/calibrate_sim.py` to published
measurements, or marked as estimates with their derivation (`jserve/runners/data/
published_a100.json`). `docs/simulator.md` lists them.

Every fitted term also records the range its measurements covered (`FitRange`); a run
outside it prints one warning naming the term (`FitRangeWatch`).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any


class _StderrLine(logging.Handler):
    """`warning: ...` on whatever stderr is when a warning is raised, whatever else has
    configured the root logger (orbax's absl logging does at import)."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(f"warning: {record.getMessage()}\n")


log = logging.getLogger("jserve.simulator")
log.addHandler(_StderrLine())
log.propagate = False


@dataclass(frozen=True)
class FitRange:
    """What the measurements behind a term covered: the most sequences in one step, the
    longest mean context per sequence (tokens), the most tokens in one step, and the
    tensor-parallel degrees. None: not limited (the term does not depend on it)."""

    max_batch: int | None = None
    max_context: int | None = None
    max_tokens: int | None = None
    tensor_parallel: tuple[int, ...] | None = None

    def beyond(self, num_seqs: int, mean_context: float, num_tokens: int) -> str | None:
        """How a step of this size leaves the range (None: it does not)."""
        if self.max_batch is not None and num_seqs > self.max_batch:
            return f"fitted on steps of at most {self.max_batch} sequences, this run steps {num_seqs}"
        if self.max_context is not None and mean_context > self.max_context:
            return (f"fitted on contexts of at most {self.max_context} tokens, this run reaches "
                    f"{mean_context:.0f}")
        if self.max_tokens is not None and num_tokens > self.max_tokens:
            return f"fitted on steps of at most {self.max_tokens} tokens, this run steps {num_tokens}"
        return None

    def beyond_tp(self, tensor_parallel: int) -> str | None:
        if self.tensor_parallel is None or tensor_parallel in self.tensor_parallel:
            return None
        degrees = ", ".join(map(str, self.tensor_parallel))
        return f"fitted at tensor parallelism {degrees}, this run uses {tensor_parallel}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FitRange:
        tp = d.get("tensor_parallel")
        return cls(d.get("max_batch"), d.get("max_context"), d.get("max_tokens"),
                   None if tp is None else tuple(tp))


@dataclass(frozen=True)
class EngineOverhead:
    """One serving stack's time per busy step outside the GPU's kernels.

    - `step` + `per_seq * sequences`: the CPU's scheduling, input preparation, sampling and
      output processing, serial with the GPU (vLLM v0 steps synchronously);
    - `worker_step`: what driving the other workers of a tensor-parallel group adds to each
      step (Ray RPCs and input broadcasts in vLLM v0), only when the group has > 1 GPU;
    - `eager_launch`: the GPU's idle time per kernel launched one by one from Python; a
      decode-only step of at most `cuda_graph_max_batch` sequences replays a CUDA graph and
      pays none (0: the stack never uses graphs; vLLM captures decodes only);
    - `gpu_slowdown`: this stack's kernels against the profiled ones (older attention
      kernels, unfused operators), a factor on the GPU's work;
    - `pads_prompts`: the prompts of a prefill step are padded to the longest and run as
      one 2-D batch (vLLM 0.2.x's `_prepare_prompt`), so its linear layers compute
      prompts x longest tokens; charged only to a policy that `pads_prompts` too (the
      `vllm-0.2.3` scheduler, which bounds the padding), see `builder.sim_cost_model`.

    `estimate` marks a profile no published measurement fixes; `source` says where each term
    comes from, or how it was derived. `fit_range` is what `step` and `per_seq` were fitted
    on; `worker_range` the tensor-parallel degrees `worker_step` was."""

    name: str
    source: str
    step: float = 0.0
    per_seq: float = 0.0
    worker_step: float = 0.0
    eager_launch: float = 0.0
    cuda_graph_max_batch: int = 0
    gpu_slowdown: float = 1.0
    pads_prompts: bool = False
    estimate: bool = False
    fit_range: FitRange = FitRange()
    worker_range: FitRange = FitRange()

    def __post_init__(self) -> None:
        for field in ("step", "per_seq", "worker_step", "eager_launch"):
            if getattr(self, field) < 0:
                raise ValueError(f"engine overhead {self.name!r}: {field} must be >= 0")
        if self.gpu_slowdown <= 0 or self.cuda_graph_max_batch < 0:
            raise ValueError(f"engine overhead {self.name!r}: gpu_slowdown must be > 0 and "
                             "cuda_graph_max_batch >= 0")

    def cpu_time(self, num_seqs: int, tensor_parallel: int) -> float:
        """The stack's serial time of a busy step of `num_seqs` sequences."""
        workers = self.worker_step if tensor_parallel > 1 else 0.0
        return self.step + self.per_seq * num_seqs + workers

    def launches_eagerly(self, num_seqs: int, prefill: bool) -> bool:
        """Whether a step launches its kernels one by one: every step without CUDA graphs,
        and with them every step that prefills or decodes more than the captured batch."""
        return prefill or num_seqs > self.cuda_graph_max_batch

    def describe(self) -> str:
        graphs = (f"CUDA graphs to batch {self.cuda_graph_max_batch}" if self.cuda_graph_max_batch
                  else "eager" if self.eager_launch else "launches not modelled")
        return (f"{self.name} ({graphs}; {self.step * 1e3:.2f} ms + {self.per_seq * 1e3:.3f} ms/seq a step"
                f"{f', +{self.worker_step * 1e3:.1f} ms at TP > 1' if self.worker_step else ''}"
                f"{', an estimate' if self.estimate else ''})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineOverhead:
        ranges = {k: FitRange.from_dict(d[k]) for k in ("fit_range", "worker_range") if k in d}
        return cls(**{k: v for k, v in d.items() if k not in ranges} | ranges)


# The roofline's stand-in for a stack: a flat 2 ms a busy step, the middle of what vLLM-era
# engines spend on scheduling, inputs, sampling and launches (1-3 ms; less with CUDA graphs).
FLAT_2MS = EngineOverhead("flat-2ms", "a planning figure, not a measurement: 1-3 ms of host work a "
                          "step is typical of vLLM-era engines", step=2e-3, estimate=True)
KERNELS_ONLY = EngineOverhead("kernels-only", "the GPU's work alone")


class FitRangeWatch:
    """Warns once per term and process (in `jserve.simulator`'s log) when a step goes beyond
    what that term was fitted on, however many engines a sweep builds. Each term is `(label,
    FitRange)`; `check` costs a few comparisons a step."""

    warned: set[str] = set()  # the terms warned of in this process

    def __init__(self, terms: list[tuple[str, FitRange]], tensor_parallel: int,
                 tp_terms: list[tuple[str, FitRange]] = ()) -> None:
        self.terms = [(label, r) for label, r in terms if r != FitRange()]
        for label, r in tp_terms:
            self._warn(label, r.beyond_tp(tensor_parallel))

    def _warn(self, label: str, why: str | None) -> None:
        if why is None or label in self.warned:
            return
        self.warned.add(label)
        log.warning("%s: %s; the simulator extrapolates it", label, why)

    def check(self, num_seqs: int, mean_context: float, num_tokens: int) -> None:
        for label, r in self.terms:
            if label not in self.warned:
                self._warn(label, r.beyond(num_seqs, mean_context, num_tokens))
