"""The simulator's step-time models by name (`EngineConfig.cost_model`, `--cost-model`).

- `measured` (the default): vLLM as measured, `MeasuredCostModel` with the kernel
  efficiencies fitted to Vidur's A100 profiles and the engine overhead of vLLM 0.2.3's online
  server fitted to its real runs (`bench/calibrate_sim.py`; `bench/sim_vs_real.py` replays
  them). Measured on the A100; on other hardware the same fractions of its datasheet peaks,
  an estimate (`CostModelInfo.estimate`).
- `measured-vidur`: the same kernels with the CPU time per step Vidur profiled of a later,
  leaner vLLM run offline (what vLLM's offline throughput benchmark sees).
- `roofline`: the ideal `RooflineCostModel` (conventional MFU 0.6 / MBU 0.8 and a flat 2 ms
  per step), for what-if questions; about twice too fast against real vLLM runs.
- A paper's testbed (`apt-serve`, `layerkv`): the measured kernels on the paper's hardware,
  with the engine's CPU time per sequence fitted (`bench/testbeds.py`) so that vLLM on the
  simulator reaches the capacity the paper states for its own vLLM; each names its hardware
  and refuses another. CacheOpt and T-LRU state no step time or vLLM capacity of their
  testbeds: they run on `measured` (both used A100-80GB-class GPUs).

A `--profile` from `jserve profile` overrides all of them: it measures jserve's own runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from jserve.models.config import ModelConfig
from jserve.runners.cost_model import RooflineCostModel, SwapPath
from jserve.runners.hardware import Hardware
from jserve.runners.measured_cost import MEASURED_CHIPS, EngineOverhead, MeasuredCostModel, published_fit

DEFAULT_COST_MODEL = "measured"
# The engine whose measured overhead `measured` adds to the kernels.
MEASURED_ENGINE = "vllm-0.2.3"
# The paper testbeds' CPU time per sequence per step, fitted by `bench/testbeds.py`.
APT_SERVE_PER_SEQ = 0.244e-3
LAYERKV_PER_SEQ = 0.178e-3


@dataclass(frozen=True)
class CostModelInfo:
    """A named step-time model: how to make it and what it stands for."""

    name: str
    summary: str
    make: Callable[[ModelConfig, Hardware, int, int, SwapPath], RooflineCostModel]
    measured_on: tuple[str, ...] = ()  # hardware it was measured on; elsewhere an estimate
    hardware: str | None = None  # the only hardware it models (a paper's testbed)

    def estimate(self, hw: Hardware) -> bool:
        return hw.name not in self.measured_on

    def check_hardware(self, hardware: str) -> None:
        if self.hardware is not None and hardware != self.hardware:
            raise ValueError(f"cost model {self.name!r} is the paper's testbed on {self.hardware}: "
                             f"pass --hardware {self.hardware}, not {hardware}")


@dataclass(frozen=True)
class PaperTestbed:
    """A paper's serving testbed: the measured kernels on its hardware, and an engine whose
    CPU time per sequence is fitted so that vLLM reaches the capacity the paper states
    (`bench/testbeds.py` fits `per_seq` and prints every figure the paper states beside the
    testbed's)."""

    name: str
    paper: str
    hardware: str
    base_engine: str  # the shipped engine whose other terms it keeps
    per_seq: float  # seconds per sequence per step, fitted
    states: str  # what the paper states, that `per_seq` is fitted to

    def engine(self) -> EngineOverhead:
        base = published_fit().engines[self.base_engine]
        return dataclasses.replace(base, name=f"{self.name} testbed", per_seq=self.per_seq,
                                   source=f"{self.paper}: {self.states}")


PAPER_TESTBEDS: dict[str, PaperTestbed] = {t.name: t for t in [
    PaperTestbed("apt-serve", "Apt-Serve (SIGMOD 2025), Section 3.1 / Figure 2a", "a100-40g",
                 MEASURED_ENGINE, per_seq=APT_SERVE_PER_SEQ,
                 states="vLLM serving OPT-13B on one A100-40GB reaches 90% SLO attainment (TTFT and "
                        "P99 TBT 1 s, 500 ShareGPT requests, Poisson) near 2.6 req/s"),
    PaperTestbed("layerkv", "LayerKV, Section 5.2.4 / Figure 8", "l20", "vllm-vidur",
                 per_seq=LAYERKV_PER_SEQ,
                 states="vLLM 0.5.5 serving Llama-2-7B on one L20 begins to violate its SLOs (TTFT "
                        "3 s, TPOT 200 ms, ShareGPT, Poisson) at 6 req/s"),
]}


def measured_from(engine: Callable[[], EngineOverhead]) -> Callable[[ModelConfig, Hardware, int, int, SwapPath],
                                                                  MeasuredCostModel]:
    def make(cfg: ModelConfig, hw: Hardware, dtype_bytes: int, tp: int, swap_path: SwapPath) -> MeasuredCostModel:
        return MeasuredCostModel(cfg, hw, dtype_bytes, tp, swap_path, kernels=published_fit().kernels,
                                 engine=engine())

    return make


def _roofline(cfg: ModelConfig, hw: Hardware, dtype_bytes: int, tp: int, swap_path: SwapPath) -> RooflineCostModel:
    return RooflineCostModel(cfg, hw, dtype_bytes, tp, swap_path=swap_path)


TESTBEDS: dict[str, CostModelInfo] = {info.name: info for info in [
    CostModelInfo("measured", "vLLM as measured on A100s (Vidur's kernels, vLLM 0.2.3's online engine)",
                  measured_from(lambda: published_fit().engines[MEASURED_ENGINE]), MEASURED_CHIPS),
    CostModelInfo("measured-vidur", "Vidur's kernels and its profile of vLLM's CPU time per step "
                  "(a later, leaner vLLM, run offline)",
                  measured_from(lambda: published_fit().engines["vllm-vidur"]), MEASURED_CHIPS),
    CostModelInfo("roofline", "ideal roofline (MFU 0.6, MBU 0.8, 2 ms a step), for what-if questions",
                  _roofline),
    *(CostModelInfo(t.name, f"{t.paper}'s testbed: {t.states}", measured_from(t.engine), hardware=t.hardware)
      for t in PAPER_TESTBEDS.values()),
]}
COST_MODELS: tuple[str, ...] = tuple(TESTBEDS)


def make_cost_model(name: str, cfg: ModelConfig, hw: Hardware, dtype_bytes: int = 2,
                    tensor_parallel: int = 1,
                    swap_path: SwapPath = SwapPath.PER_BLOCK_LAYER) -> RooflineCostModel:
    info = cost_model_info(name)
    info.check_hardware(hw.name)
    return info.make(cfg, hw, dtype_bytes, tensor_parallel, swap_path)


def cost_model_info(name: str) -> CostModelInfo:
    try:
        return TESTBEDS[name]
    except KeyError:
        raise ValueError(f"unknown cost model {name!r}; known: {', '.join(COST_MODELS)}") from None


def describe(name: str, hardware: Hardware) -> str:
    """One line saying what a simulated step costs and how far it was measured, for reports."""
    info = cost_model_info(name)
    scaled = ", an estimate: measured on A100s and scaled by the datasheet" if info.estimate(hardware) and \
        info.measured_on else ""
    return f"cost model {name} ({info.summary}{scaled})"
