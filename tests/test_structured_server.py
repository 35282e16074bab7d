"""Structured outputs over HTTP: `response_format` (json_schema) on chat and completions,
`tools` with `tool_choice` "required" or a named function answered as OpenAI's
`tool_calls`, through the `openai` client; and every mode or field this server does not
support refused with a 400 naming it. The model is SmolLM2's tokenizer over two layers of
random weights: only the grammar makes its output valid."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from conftest import SMOL_ENGINE
from jserve import LLM
from jserve.models.loading import LoadedModel
from jserve.serving.server import build_app, serve_in_background

from test_structured import BOUNDED, WEATHER

MODEL = "tiny-llama-smollm2-vocab"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER_TOOL = {"type": "function", "function": {"name": WEATHER.name, "description": "the weather",
                                                 "parameters": json.loads(WEATHER.parameters)}}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time"}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": BOUNDED}}


@pytest.fixture(scope="module")
def server(tiny_smollm2_vocab: LoadedModel) -> Iterator[tuple[str, openai.OpenAI]]:
    llm = LLM(tiny_smollm2_vocab, warmup=False, **SMOL_ENGINE)
    with serve_in_background(build_app(llm)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield url, client
        client.close()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 3}])
def test_chat_json_schema_validates(server, sampling) -> None:
    _, client = server
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64,
                                         response_format=SCHEMA_FORMAT, **sampling)
    [choice] = out.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), BOUNDED)


def test_streamed_json_schema_equals_non_streamed(server) -> None:
    _, client = server
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0, response_format=SCHEMA_FORMAT)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole


def test_completion_json_schema_validates(server) -> None:
    _, client = server
    out = client.completions.create(model=MODEL, prompt="A person:", max_tokens=64, temperature=0,
                                    extra_body={"response_format": SCHEMA_FORMAT})
    jsonschema.validate(json.loads(out.choices[0].text), BOUNDED)


def test_named_tool_choice_answers_one_tool_call(server) -> None:
    _, client = server
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, temperature=1, seed=5,
        tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), json.loads(WEATHER.parameters))


def test_a_tool_call_cut_short_comes_back_as_content(server) -> None:
    _, client = server
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [choice] = out.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("{")


def test_required_tool_choice_calls_any_of_the_tools(server) -> None:
    _, client = server
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=128, temperature=1,
                                         seed=1, tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice="required")
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        schema = json.loads(WEATHER.parameters) if call.function.name == "get_weather" else {"maxProperties": 0}
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [WEATHER_TOOL]}, "tool_choice"),  # "auto" by default, which needs a tool parser
    ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "stream": True}, "stream"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_unsupported_modes_are_400s_naming_them(server, extra, param) -> None:
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tool_choice_none_generates_text(server) -> None:
    _, client = server
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                         tools=[WEATHER_TOOL], tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content is not None
