"""What the server refuses before a request reaches the engine (API key, body size, a full
queue), a shutdown that drains, a busy port found before the model loads, and routes that
keep answering while a large prompt is tokenized."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from jserve import LLM
from jserve.benchmarking.http_client import wait_until_idle
from jserve.config import ServerConfig
from jserve.serving.server import build_app, serve_in_background
from jserve.models.loading import LoadedModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "stream": True}


def _tiny(loaded: LoadedModel, **server: object) -> Iterator[str]:
    llm = LLM(loaded, num_blocks=64, max_model_len=512, max_num_seqs=1, max_num_batched_tokens=512,
              warmup=False)
    with serve_in_background(build_app(llm, ServerConfig(**server))) as url:
        yield url


@pytest.fixture(scope="module")
def guarded(tiny_loaded: LoadedModel) -> Iterator[str]:
    yield from _tiny(tiny_loaded, api_key=KEY, max_request_bytes=4096, max_waiting_requests=2)


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_api_key_guards_every_v1_route_but_not_health_or_metrics(guarded: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert _openai_error(httpx.get(f"{guarded}/v1/models", headers=headers), 401)["code"] == "invalid_api_key"
        _openai_error(httpx.post(f"{guarded}/v1/completions", content=b"{not json", headers=headers), 401)
    assert httpx.get(f"{guarded}/health").status_code == 200
    assert httpx.get(f"{guarded}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{guarded}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model="tiny-llama", prompt=[5, 6], max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_large_bodies_get_413_declared_or_chunked(guarded: str) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": [1] * 2000}).encode()
    assert len(body) > 4096
    _openai_error(httpx.post(f"{guarded}/v1/completions", content=body, headers=AUTH), 413)
    headers = AUTH | {"Content-Type": "application/json"}
    chunked = httpx.post(f"{guarded}/v1/completions", content=iter([body[:3000], body[3000:]]),
                         headers=headers)
    assert "content-length" not in chunked.request.headers
    _openai_error(chunked, 413)
    small = json.dumps({"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 1}).encode()
    ok = httpx.post(f"{guarded}/v1/completions", content=iter([small[:10], small[10:]]), headers=headers)
    assert ok.status_code == 200, ok.text
    assert wait_until_idle(guarded)


def test_a_full_queue_gets_503_with_retry_after(guarded: str) -> None:
    with contextlib.ExitStack() as stack, httpx.Client(headers=AUTH, timeout=30) as client:
        # max_num_seqs=1: one stream runs, two wait; headers come back once each is admitted
        for _ in range(3):
            r = stack.enter_context(client.stream("POST", f"{guarded}/v1/completions", json=LONG))
            assert r.status_code == 200
        deadline = time.monotonic() + 10
        while (full := client.post(f"{guarded}/v1/completions", json=LONG)).status_code != 503:
            assert time.monotonic() < deadline, "the queue never counted as full"
        assert full.headers["Retry-After"] == "1"
        assert _openai_error(full, 503)["type"] == "server_error"
    assert wait_until_idle(guarded)


def test_leaving_drains_streams_end_with_an_error_event_and_done(tiny_loaded: LoadedModel) -> None:
    lines: list[str] = []
    started = threading.Event()

    def read(url: str) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG | {"max_tokens": 5000},
                          timeout=30) as r:
            for line in r.iter_lines():
                started.set()
                lines.append(line)

    llm = LLM(tiny_loaded, num_blocks=512, max_model_len=8192, warmup=False)
    with serve_in_background(build_app(llm, ServerConfig(drain_s=0.5))) as url:
        reader = threading.Thread(target=read, args=(url,))
        reader.start()
        assert started.wait(30)
        t0 = time.monotonic()
    reader.join(10)
    assert time.monotonic() - t0 < 3, "the drain window is 0.5 s"
    events = [ln.removeprefix("data: ") for ln in lines if ln]
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    state = llm.engine.state
    assert not state.has_unfinished and state.blocks.num_free == state.blocks.num_blocks


PROMPT_2MB = " ".join(str(i) for i in range(300_000))  # a token per digit: slow to encode


def test_routes_answer_while_a_large_prompt_is_tokenized(smollm2_loaded: LoadedModel) -> None:
    llm = LLM(smollm2_loaded, num_blocks=16, max_model_len=256, warmup=False)
    with serve_in_background(build_app(llm, ServerConfig(max_request_bytes=8 * 2**20))) as url:
        answers: list[httpx.Response] = []
        big = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{url}/v1/completions", json={"model": "smollm2-135m", "prompt": PROMPT_2MB}, timeout=60)))
        big.start()
        time.sleep(0.5)  # the body is in; tokenizing it takes seconds
        t0 = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        waited = time.monotonic() - t0
        still_tokenizing = big.is_alive()
        big.join(60)
    assert still_tokenizing and waited < 0.5, f"/health took {waited:.2f} s"
    assert "the context limit is 256" in answers[0].json()["error"]["message"]


# ------------------------------------------------------------------ the command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jserve(*args: str) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "jserve", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_busy_port_fails_before_the_model_loads() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        t0 = time.monotonic()
        proc = _jserve("serve", "--model", "tiny-llama", "--port", str(busy.getsockname()[1]))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.strip().startswith("error: cannot listen on 127.0.0.1:")
    assert "Traceback" not in err and time.monotonic() - t0 < 30


# SIGTERM (what `docker stop` and Kubernetes send) in CI; SIGINT, the same drain, in
# bench/nightly.sh.
@pytest.mark.parametrize(("sig", "status"), [pytest.param(signal.SIGINT, 0, marks=pytest.mark.slow),
                                             (signal.SIGTERM, -signal.SIGTERM)])
def test_a_signal_drains_and_exits_without_tracebacks(sig: signal.Signals, status: int) -> None:
    """SIGTERM's status is uvicorn's: it re-raises the signal once it has shut down. The
    open stream ends when the drain window does, and the process right after, with no
    error logged (uvicorn's close window once ran out beside the drain: issue 30)."""
    port = _free_port()
    proc = _jserve("serve", "--model", "tiny-llama", "--port", str(port), "--no-warmup",
                   "--max-model-len", "4096", "--drain-timeout", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            time.sleep(0.2)
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG | {"max_tokens": 4000},
                          timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            t0 = time.monotonic()
            proc.send_signal(sig)
            rest = [ln.removeprefix("data: ") for ln in lines if ln]
            ended = time.monotonic() - t0
        _, err = proc.communicate(timeout=30)
        exited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rest[-1] == "[DONE]" and "shutting down" in rest[-2]
    assert proc.returncode == status and "Traceback" not in err and "CancelledError" not in err, err
    assert "ERROR" not in err, err
    assert ended < 1 + 2 and exited - ended < 3, f"stream ended at {ended:.1f} s, exit at {exited:.1f} s"


def test_the_api_key_comes_from_the_option_or_the_environment() -> None:
    from jserve.cli import build_parser
    from jserve.config import server_config_from_args

    def key(argv: list[str], env: dict[str, str]) -> str | None:
        return server_config_from_args(build_parser().parse_args(["serve", *argv]), env).api_key

    assert key([], {}) is None and key([], {"JSERVE_API_KEY": "env"}) == "env"
    assert key(["--api-key", "opt"], {"JSERVE_API_KEY": "env"}) == "opt"


def test_warm_up_covers_a_burst_of_short_prompts(tiny_loaded: LoadedModel) -> None:
    """A burst packs many short prompts into one prefill step (16 prompts of 2-8 tokens
    here): a step's composition is data, so warm-up's one program per token bucket serves
    it, and nothing compiles while serving."""
    from jserve import SamplingParams

    llm = LLM(tiny_loaded, num_blocks=256, max_model_len=64, max_num_seqs=16,
              max_num_batched_tokens=64, warmup=True)
    compiled = llm.runner.num_compiled
    assert compiled == len(llm.runner.buckets.shapes()) == 3
    rng = __import__("numpy").random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(2, 9, size=30)]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    assert llm.runner.num_compiled == compiled
