"""What a user moving from `vllm serve` expects of the server (issue 44): fields the server
does not know or does not implement refused by name, unencodable text refused without
losing the connection, vLLM's routes and metric names, `/health` answering 503 while the
model loads, and `vllm serve`'s positional model and flags."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import SMOL_ENGINE
from jserve import LLM
from jserve.cli import build_parser, main
from jserve.config import ServerConfig, engine_config_from_args
from jserve.errors import ConfigError
from jserve.models.loading import LoadedModel
from jserve.models.registry import get_config
from jserve.serving.openai_protocol import UNSUPPORTED_FIELDS
from jserve.serving.server import build_app, serve, serve_in_background
from jserve.serving.vllm_flags import NotSupported, apply_vllm_serve_args

HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = [3, 4, 5]


def _tiny_llm(loaded: LoadedModel) -> LLM:
    return LLM(loaded, num_blocks=32, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
               warmup=False)


COMPILE_TIMEOUT_S = 300


def _warmed(url: str, model: str, prompt: object) -> str:
    """`url` once a first completion has compiled the step (no warm-up: seconds on a busy
    machine, longer than httpx's 5 s default that the tests' requests keep)."""
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2},
                   timeout=COMPILE_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return url


@pytest.fixture(scope="module")
def tiny(tiny_loaded: LoadedModel) -> Iterator[str]:
    with serve_in_background(build_app(_tiny_llm(tiny_loaded))) as url:
        yield _warmed(url, "tiny-llama", PROMPT)


@pytest.fixture(scope="module")
def smol(tiny_smollm2_vocab: LoadedModel) -> Iterator[str]:
    """SmolLM2's tokenizer over a two-layer random model, served under two names."""
    llm = LLM(tiny_smollm2_vocab, warmup=False, **SMOL_ENGINE)
    with serve_in_background(build_app(llm, ServerConfig(served_model_names=("smollm2-135m", HF_ID)))) as url:
        yield _warmed(url, "smollm2-135m", "a b")


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err["message"]


# ------------------------------------------------------------------ fields: unknown, unsupported


def test_an_unknown_field_is_refused_by_name(tiny: str) -> None:
    body = {"model": "tiny-llama", "prompt": PROMPT, "no_such_field_xyz": 1}
    message = _error(httpx.post(f"{tiny}/v1/completions", json=body), 400, "no_such_field_xyz")
    assert "unknown field" in message
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi", "nickname": "x"}]}
    _error(httpx.post(f"{tiny}/v1/chat/completions", json=chat), 400, "messages.0.nickname")
    _error(httpx.post(f"{tiny}/tokenize", json={"prompt": "a", "bogus": True}), 400, "bogus")


@pytest.mark.parametrize("field, value", [
    ("min_p", 0.1), ("allowed_token_ids", [5]),
    ("guided_json", {"type": "object"}), ("user", "u1"),
])
def test_a_field_not_implemented_is_refused_as_not_supported(tiny: str, field: str, value: object) -> None:
    assert field in UNSUPPORTED_FIELDS
    for route, body in (("completions", {"prompt": PROMPT}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{tiny}/v1/{route}", json={"model": "tiny-llama", **body, field: value})
        assert "not supported by this server" in _error(r, 400, field)


def test_a_not_implemented_field_at_its_neutral_value_changes_nothing(tiny: str) -> None:
    base = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    neutral = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
               "logit_bias": {}, "response_format": {"type": "text"}, "best_of": None}
    plain = httpx.post(f"{tiny}/v1/completions", json=base).json()
    with_neutral = httpx.post(f"{tiny}/v1/completions", json=base | neutral).json()
    assert with_neutral["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert httpx.post(f"{tiny}/v1/completions", json=base | {"n": True}).status_code == 400  # not 1


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(tiny: str) -> None:
    """vLLM's `stream_options.continuous_usage_stats`, which guidellm sends on every stream."""
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{tiny}/v1/completions", json=body) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c["usage"]["prompt_tokens"] == len(PROMPT) for c in chunks)


def test_the_bodies_guidellm_and_lm_eval_send_are_accepted(smol: str) -> None:
    """The strict bodies take what the clients the docs name send (their request builders:
    guidellm 0.8.1's openai backend, lm-eval 0.4's local-completions and remote tokenizer)."""
    stream = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
              "stop": None, "ignore_eos": True}
    bodies = [
        ("/v1/completions", {"model": HF_ID, "prompt": "a b c", "max_tokens": 2} | stream),
        ("/v1/chat/completions", {"model": HF_ID, "messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": 2} | stream),
        ("/v1/completions", {"model": HF_ID, "prompt": ["a b", "c d"], "temperature": 0, "max_tokens": 1,
                             "logprobs": 1, "seed": 1234, "echo": True}),
        ("/v1/completions", {"prompt": ["a b"], "model": HF_ID, "max_tokens": 2, "temperature": 0,
                             "stop": ["\n"], "seed": 1234}),
        ("/tokenize", {"prompt": "test", "add_special_tokens": False}),
        ("/detokenize", {"tokens": [1, 2]}),
    ]
    for path, body in bodies:
        r = httpx.post(f"{smol}{path}", json=body)
        assert r.status_code == 200, (path, r.text)


# ------------------------------------------------------------------ unencodable text


def _raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST a JSON body written by hand: `json=` would refuse to encode a lone surrogate."""
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def test_lone_surrogates_get_a_400_at_their_field_on_one_kept_connection(smol: str) -> None:
    with httpx.Client(base_url=smol) as client:
        first = client.get("/version")
        stream = first.extensions["network_stream"]
        bad = [
            ("/v1/completions", r'{"model": "smollm2-135m", "prompt": "a\ud800b"}', "prompt"),
            ("/v1/completions", r'{"model": "smollm2-135m", "prompt": ["ok", "\udfff"]}', "prompt.1"),
            ("/v1/chat/completions", r'{"model": "smollm2-135m", "messages": [{"role": "user", '
                                     r'"content": "hi \ud83d"}]}', "messages.0.content"),
            ("/v1/chat/completions", r'{"model": "smollm2-135m", "messages": [{"role": "user", '
                                     r'"content": [{"type": "text", "text": "\ud800"}]}]}',
             "messages.0.content.0.text"),
            ("/v1/completions", r'{"model": "smollm2-135m", "prompt": "x", "stop": ["\ud800"]}', "stop.0"),
            ("/tokenize", r'{"prompt": "a\ud800b"}', "prompt"),
            ("/tokenize", r'{"messages": [{"role": "\udc00", "content": "x"}]}', "messages.0.role"),
            ("/detokenize", r'{"model": "\ud800", "tokens": [1, 2]}', "model"),
            ("/v1/completions", r'{"model": "\ud800", "prompt": "x"}', "model"),
        ]
        for path, body, param in bad:
            message = _error(_raw(client, path, body), 400, param)
            assert "cannot encode" in message and "\\u" in message
        ok = client.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "a b", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert ok.extensions["network_stream"] is stream  # the one connection kept serving
        assert client.post("/tokenize", json={"prompt": "a\u00e9\U0001f600"}).json()["count"] > 0


# ------------------------------------------------------------------ vLLM's routes


def test_version_ping_and_one_models_card(smol: str) -> None:
    assert httpx.get(f"{smol}/version").json()["version"]
    assert httpx.get(f"{smol}/ping").json()["status"] == "ok"
    assert httpx.post(f"{smol}/ping").status_code == 200
    for name in ("smollm2-135m", HF_ID):
        card = httpx.get(f"{smol}/v1/models/{name}").json()
        assert card["id"] == name and card["object"] == "model" and card["root"] == "tiny-llama-smollm2-vocab"
    r = httpx.get(f"{smol}/v1/models/gpt-4")
    _error(r, 404, "model")
    assert r.json()["error"]["code"] == "model_not_found"


def test_health_answers_503_at_once_while_the_model_loads(tiny_loaded: LoadedModel) -> None:
    release = threading.Event()

    def load() -> LLM:
        release.wait(60)
        return _tiny_llm(tiny_loaded)

    with serve_in_background(build_app(load)) as url:
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and "loading" in health.json()["error"]["message"]
        assert health.headers["Retry-After"] == "1"
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": PROMPT}, timeout=5)
        assert r.status_code == 503
        for path in ("/v1/models", "/ping", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=5).status_code == 503
        assert httpx.get(f"{url}/version", timeout=5).status_code == 200
        release.set()
        with httpx.Client(base_url=url, timeout=5) as client:
            while client.get("/health").status_code == 503:
                threading.Event().wait(0.05)
            assert client.get("/health").json()["status"] == "ok"
            done = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": PROMPT,
                                                        "max_tokens": 2, "ignore_eos": True},
                               timeout=COMPILE_TIMEOUT_S)
            assert done.json()["usage"]["completion_tokens"] == 2


def test_a_model_that_fails_to_load_stops_the_server_with_its_error() -> None:
    def load() -> LLM:
        raise ConfigError("no such checkpoint")

    with pytest.raises(ConfigError, match="no such checkpoint"):
        serve(load, ServerConfig(port=0), log_level="warning")


# ------------------------------------------------------------------ vLLM's metrics


def _families(url: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}


def _value(family: object, sample_name: str, **labels: str) -> float:
    return sum(s.value for s in family.samples  # type: ignore[attr-defined]
               if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()))


VLLM_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


def test_metrics_have_vllms_names_types_and_labels_and_move_with_requests(tiny: str) -> None:
    before = _families(tiny)
    for name, kind in VLLM_TYPES.items():
        assert before[name].type == kind, name  # type: ignore[attr-defined]
        assert all(s.labels["model_name"] == "tiny-llama" for s in before[name].samples)  # type: ignore[attr-defined]
    assert "jserve_requests_running" in before  # jserve's own stay beside them
    ttft_bounds = [s.labels["le"] for s in before["vllm:time_to_first_token_seconds"].samples  # type: ignore[attr-defined]
                   if s.name.endswith("_bucket")]
    assert ttft_bounds[:3] == ["0.001", "0.005", "0.01"] and ttft_bounds[-1] == "+Inf"

    for _ in range(2):
        r = httpx.post(f"{tiny}/v1/completions", json={"model": "tiny-llama", "prompt": PROMPT,
                                                       "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200
    after = _families(tiny)

    def moved(name: str, sample: str, **labels: str) -> float:
        return _value(after[name], sample, **labels) - _value(before[name], sample, **labels)

    assert moved("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 2 * len(PROMPT)
    assert moved("vllm:generation_tokens", "vllm:generation_tokens_total") == 2 * 4
    assert moved("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 2 * 3
    assert moved("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == 2
    assert _value(after["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc") == 0  # idle again
    assert _value(after["vllm:num_requests_running"], "vllm:num_requests_running") == 0


# ------------------------------------------------------------------ vLLM's command line


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_the_positional_model_and_vllms_aliases_reach_the_engine_config() -> None:
    args = _serve_args("tiny-llama", "--enable-prefix-caching", "--seed", "7", "--tokenizer", "tiny-llama",
                       "--max-logprobs", "20", "--disable-log-requests", "--uvicorn-log-level", "warning")
    options = apply_vllm_serve_args(args)
    config = options.engine_config(engine_config_from_args(args))
    assert config.model == "tiny-llama" and config.seed == 7
    assert config.prefix_cache is not None and config.prefix_cache.eviction == "lru"
    assert options.log_level == "warning"
    tlru = _serve_args("--model", "tiny-llama", "--enable-prefix-caching", "--prefix-cache", "tlru")
    apply_vllm_serve_args(tlru)
    assert engine_config_from_args(tlru).prefix_cache.eviction == "tlru"
    assert engine_config_from_args(_serve_args()).prefix_cache is None  # jserve's default: off


@pytest.mark.parametrize("argv, message", [
    (["--enforce-eager"], "--enforce-eager is not supported"),
    (["--chat-template", "t.jinja"], "--chat-template is not supported"),
    (["--tokenizer", "other/tok"], "--tokenizer 'other/tok' is not supported"),
    (["--max-logprobs", "5"], "--max-logprobs 5 is not supported"),
    (["tiny-llama", "--model", "tiny-opt"], "two models given"),
    (["--no-enable-prefix-caching", "--prefix-cache", "lru"], "contradicts --prefix-cache lru"),
])
def test_vllm_flags_jserve_lacks_are_one_clear_error(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(NotSupported, match=message.replace("'", ".")):
        apply_vllm_serve_args(_serve_args(*argv))
    assert main(["serve", *argv]) == 2  # before any model loads or port is bound
    assert message in capsys.readouterr().err



SMOL_EOS = get_config("smollm2-135m").eos_token_id


def test_token_rules_over_http_and_bad_values_name_their_field(smol: str) -> None:
    """min_tokens, logit_bias and bad_words reach the sampler; a bad value is a 400 naming
    its field (the vocabulary's and the tokenizer's checks included)."""
    base = {"model": HF_ID, "prompt": "a b c", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    biased = httpx.post(f"{smol}/v1/completions", json=base | {"logit_bias": {"42": 500}}).json()
    assert biased["choices"][0]["token_ids"] == [42] * 6  # clamped to 100, still the largest
    hello = {"logit_bias": {"28120": 100, "33662": 100}}  # "hello" and " hello", one token each
    assert set(httpx.post(f"{smol}/v1/completions", json=base | hello).json()["choices"][0]["token_ids"]) \
        <= {28120, 33662}
    banned = httpx.post(f"{smol}/v1/completions", json=base | hello | {"bad_words": ["hello"]}).json()
    assert not {28120, 33662} & set(banned["choices"][0]["token_ids"])
    eos = {"ignore_eos": False, "logit_bias": {str(SMOL_EOS): 100}}  # EOS is all it would say
    assert len(httpx.post(f"{smol}/v1/completions", json=base | eos).json()["choices"][0]["token_ids"]) == 1
    held = httpx.post(f"{smol}/v1/completions", json=base | eos | {"min_tokens": 4}).json()["choices"][0]
    assert len(held["token_ids"]) == 5 and held["finish_reason"] == "stop"
    for field, value, param in (("min_tokens", -1, None), ("min_tokens", 7, None), ("logit_bias", {"x": 1}, None),
                                ("logit_bias", {"99999999": 1}, None), ("logit_bias", {"1": "a"}, "logit_bias.1"),
                                ("bad_words", [""], None), ("bad_words", ["antidisestablishmentarianism"], None),
                                ("bad_words", "x", None)):
        _error(httpx.post(f"{smol}/v1/completions", json=base | {field: value}), 400, param or field)
        chat = {"model": HF_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, field: value}
        _error(httpx.post(f"{smol}/v1/chat/completions", json=chat), 400, param or field)


def test_penalties_are_accepted_and_bad_values_name_their_field(tiny: str) -> None:
    base = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    plain = httpx.post(f"{tiny}/v1/completions", json=base).json()["choices"][0]["token_ids"]
    penalised = httpx.post(f"{tiny}/v1/completions", json=base | {"repetition_penalty": 5.0,
                                                                  "frequency_penalty": 2.0}).json()
    assert len(penalised["choices"][0]["token_ids"]) == len(plain)
    for field, value in (("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0)):
        _error(httpx.post(f"{tiny}/v1/completions", json=base | {field: value}), 400, field)
