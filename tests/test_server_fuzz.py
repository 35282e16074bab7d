"""Schema fuzzing of the HTTP API with schemathesis, from the OpenAPI document FastAPI
serves: whatever a client sends, no 5xx, every 4xx in OpenAI's error shape, and afterwards
the engine still serves and holds no request or block."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jserve import LLM
from jserve.benchmarking.http_client import wait_until_idle
from jserve.config import ServerConfig
from jserve.serving.server import build_app, serve_in_background
from jserve.models.loading import LoadedModel

EXAMPLES = 60  # per operation: seconds in all on tiny-llama with a 64-token context


@pytest.fixture(scope="module")
def served(tiny_loaded: LoadedModel) -> Iterator[tuple[str, LLM]]:
    # A short context bounds what any fuzzed max_tokens can ask for.
    llm = LLM(tiny_loaded, num_blocks=64, max_model_len=64, max_num_seqs=8,
              max_num_batched_tokens=64, warmup=False)
    with serve_in_background(build_app(llm, ServerConfig(max_request_bytes=64 * 1024))) as url:
        yield url, llm


def _operations(url: str) -> list[schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json").json())
    return [result.ok() for result in schema.get_all_operations()]


def test_fuzzed_requests_get_no_5xx_and_openai_errors(served: tuple[str, LLM]) -> None:
    url, llm = served
    seen: dict[int, int] = {}
    for operation in _operations(url):
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def check(data: st.DataObject) -> None:
            case = data.draw(operation.as_strategy())
            if isinstance(case.body, dict) and data.draw(st.integers(0, 4)) < 4:  # hypothesis favours 0
                # mostly past the 404 and the tokenizer-less model's refusals, into sampling
                # validation and the engine
                case.body["model"] = "tiny-llama"
                if "prompt" in case.body and not data.draw(st.booleans()):
                    case.body["prompt"] = data.draw(st.lists(st.integers(0, 511), min_size=1, max_size=8))
            # generous: a request may compile a step bucket first (no warm-up), slow on a loaded CI box
            response = case.call(base_url=url, timeout=120)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.path, case.body, response.text)
            if 400 <= response.status_code < 500:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, response.text
                assert isinstance(error["message"], str) and error["message"]

        check()
    # the fuzzer reached both the error paths and generation
    assert seen.get(400, 0) > 10 and seen.get(200, 0) > 10, seen
    assert wait_until_idle(url)
    out = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2],
                                                    "max_tokens": 3, "ignore_eos": True})
    assert out.json()["usage"]["completion_tokens"] == 3
    state = llm.engine.state
    assert not state.has_unfinished and state.blocks.num_free == state.blocks.num_blocks
    state.check_invariants()
