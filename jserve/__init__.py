"""jserve: LLM inference serving in JAX with pluggable KV-cache and scheduling policies."""

from jserve.engine.request import RequestOutput
from jserve.engine.sampling_params import SamplingParams
from jserve.errors import InvalidRequestError, PlanError
from jserve.serving.llm import LLM

__all__ = ["LLM", "InvalidRequestError", "PlanError", "RequestOutput", "SamplingParams"]
