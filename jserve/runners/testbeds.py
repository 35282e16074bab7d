"""The simulator's step-time models by name (`--cost-model`), each with the serving stack it
charges (`--engine-overhead`): `measured` (the default), `roofline` and the papers' testbeds.
Which stack each defaults to and why: docs/simulator.md, Cost models by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jserve.models.config import ModelConfig
from jserve.runners.cost_model import RooflineCostModel, SwapPath
from jserve.runners.engine_overhead import EngineOverhead
from jserve.runners.hardware import Hardware
from jserve.runners.measured_cost import MEASURED_CHIPS, MeasuredCostModel, engine_overhead, published_fit

DEFAULT_COST_MODEL = "measured"
DEFAULT_ENGINE_OVERHEAD = "vllm-0.2.3-server"
ENGINE_OVERHEADS: tuple[str, ...] = tuple(published_fit().engines)

Make = Callable[[ModelConfig, Hardware, int, int, SwapPath, EngineOverhead], RooflineCostModel]


@dataclass(frozen=True)
class CostModelInfo:
    """A named step-time model: how to make its GPU work, the stack it charges by default,
    and what it stands for."""

    name: str
    summary: str
    make: Make
    engine_overhead: str  # the stack it charges unless another is named
    measured_on: tuple[str, ...] = ()  # hardware it was measured on; elsewhere an estimate
    hardware: str | None = None  # the only hardware it models (a paper's testbed)
    paper: str = ""  # a testbed's paper and what it states of its stack

    def estimate(self, hw: Hardware) -> bool:
        return hw.name not in self.measured_on

    def check_hardware(self, hardware: str) -> None:
        if self.hardware is not None and hardware != self.hardware:
            raise ValueError(f"cost model {self.name!r} is the paper's testbed on {self.hardware}: "
                             f"pass --hardware {self.hardware}, not {hardware}")

    def engine(self, stack: str | EngineOverhead | None) -> EngineOverhead:
        """The stack to charge: a profile's name, a profile, or this model's own when None. A
        testbed keeps its paper's stack."""
        name = getattr(stack, "name", stack)
        if self.hardware is not None and name not in (None, self.engine_overhead):
            raise ValueError(f"cost model {self.name!r} is the paper's testbed under {self.engine_overhead}: "
                             f"pass --cost-model measured to charge another stack, not {name}")
        if isinstance(stack, EngineOverhead):
            return stack
        return engine_overhead(stack or self.engine_overhead)


def _measured(cfg: ModelConfig, hw: Hardware, dtype_bytes: int, tp: int, swap_path: SwapPath,
              engine: EngineOverhead) -> MeasuredCostModel:
    return MeasuredCostModel(cfg, hw, dtype_bytes, tp, swap_path, kernels=published_fit().kernels, engine=engine)


def _roofline(cfg: ModelConfig, hw: Hardware, dtype_bytes: int, tp: int, swap_path: SwapPath,
              engine: EngineOverhead) -> RooflineCostModel:
    return RooflineCostModel(cfg, hw, dtype_bytes, tp, engine=engine, swap_path=swap_path)


TESTBEDS: dict[str, CostModelInfo] = {info.name: info for info in [
    CostModelInfo("measured", "the GPU's work as Vidur's A100 kernel profiles price it", _measured,
                  DEFAULT_ENGINE_OVERHEAD, MEASURED_CHIPS),
    CostModelInfo("roofline", "ideal roofline (MFU 0.6, MBU 0.8), for what-if questions", _roofline, "flat-2ms"),
    CostModelInfo("apt-serve", "Apt-Serve's testbed: OPT on A100-40GB under vLLM 0.5.0.post1 with "
                  "--enforce-eager", _measured, "vllm-0.5-eager", MEASURED_CHIPS, "a100-40g",
                  "Apt-Serve (SIGMOD 2025), Section 6 and its README: vLLM 0.5.0.post1, --enforce-eager, "
                  "one A100-40GB for OPT-13B"),
    CostModelInfo("layerkv", "LayerKV's testbed: L20 48GB under vLLM 0.5.5's server with CUDA graphs",
                  _measured, "vllm-0.5-server", MEASURED_CHIPS, "l20",
                  "LayerKV, Section 5.1: L20 48GB GPUs, two sharing a PCIe link, PyTorch 2.4.0, CUDA 12.2, "
                  "vLLM 0.5.5"),
]}
COST_MODELS: tuple[str, ...] = tuple(TESTBEDS)
PAPER_TESTBEDS: dict[str, CostModelInfo] = {k: v for k, v in TESTBEDS.items() if v.hardware is not None}


def make_cost_model(name: str, cfg: ModelConfig, hw: Hardware, dtype_bytes: int = 2,
                    tensor_parallel: int = 1, swap_path: SwapPath = SwapPath.PER_BLOCK_LAYER,
                    engine_overhead: str | EngineOverhead | None = None) -> RooflineCostModel:
    info = cost_model_info(name)
    info.check_hardware(hw.name)
    return info.make(cfg, hw, dtype_bytes, tensor_parallel, swap_path, info.engine(engine_overhead))


def cost_model_info(name: str) -> CostModelInfo:
    try:
        return TESTBEDS[name]
    except KeyError:
        raise ValueError(f"unknown cost model {name!r}; known: {', '.join(COST_MODELS)}") from None


def describe(name: str, hardware: Hardware, engine: str | EngineOverhead | None = None) -> str:
    """One line naming the GPU model and the stack a simulated step is charged for, and how
    far each was measured, for reports."""
    info = cost_model_info(name)
    scaled = ", an estimate: measured on A100s and scaled by the datasheet" if info.estimate(hardware) and \
        info.measured_on else ""
    return (f"cost model {name} ({info.summary} on {hardware.name}{scaled}), "
            f"engine overhead {info.engine(engine).describe()}")


def simulated_stack(cost_model: str, hardware: Hardware, engine: str | EngineOverhead | None,
                    profile: str | None) -> dict[str, str]:
    """What a simulated run charges, for its JSON: the GPU's model and the stack's profile by
    name, or the profile file that replaces both."""
    if profile:
        return {"profile": profile, "hardware": hardware.name}
    info = cost_model_info(cost_model)
    overhead = info.engine(engine)
    return {"hardware": hardware.name, "gpu": cost_model, "engine_overhead": overhead.name,
            "gpu_estimate": str(info.estimate(hardware)), "engine_overhead_estimate": str(overhead.estimate),
            "description": describe(cost_model, hardware, engine)}
