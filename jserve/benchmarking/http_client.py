"""The benchmark's HTTP backend: replay a trace against a running `jserve serve`.

Each trace request is sent at its arrival offset as a streaming `/v1/completions` call with
the in-process benchmark's sampling settings (greedy, exactly `output_len` tokens, EOS
ignored). Times are taken on this side of the network, when each event arrives, so TTFT
and TBT include HTTP and SSE overhead, as a client sees them. Engine-wide counts (steps,
KV blocks) come from the server's `/metrics` before and after the run; the same readers
serve tests and load scripts that watch a server from outside.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from jserve.benchmarking.metrics import EngineTotals, RequestRecord
from jserve.benchmarking.replay import benchmark_params
from jserve.benchmarking.workload import Trace, TraceRequest
from jserve.config import API_KEY_ENV

# Only connecting is timed out: a request may rightly wait long in the server's queue.
CONNECT_TIMEOUT_S = 30.0


class ServerRejected(RuntimeError):
    """The server answered a benchmark request with an error status: the run is invalid."""


@dataclass(frozen=True)
class HttpRun:
    records: list[RequestRecord]
    totals: EngineTotals


def replay_http(
    url: str, model: str, policy: str, trace: Trace, random_ids: Callable[[int], list[int]],
    on_finish: Callable[[RequestRecord], None] | None = None,
) -> HttpRun:
    """Run the whole trace against the server at `url` (blocking)."""
    return asyncio.run(_replay(url.rstrip("/"), model, policy, trace, random_ids, on_finish))


async def _replay(url: str, model: str, policy: str, trace: Trace,
                  random_ids: Callable[[int], list[int]],
                  on_finish: Callable[[RequestRecord], None] | None) -> HttpRun:
    # Text goes as text (the server tokenizes it as the in-process benchmark does); synthetic
    # prompts are drawn here, in trace order, as the in-process benchmark draws them.
    prompts = [r.prompt if r.prompt is not None else random_ids(r.prompt_len) for r in trace.requests]
    # One connection per request, closed after it. Streams are long, so reuse saves little;
    # and with hundreds of streams httpcore's pool hands queued requests to idle connections
    # slowly (tens per second here), where a reused connection also races the server's
    # keep-alive timeout ("server disconnected without sending a response").
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
    key = os.environ.get(API_KEY_ENV)  # a server started with --api-key wants it on /v1
    headers = {} if not key else {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, headers=headers) as client:
        await _check_server(client, model, policy)
        before = await _engine_totals(client)
        start = time.perf_counter()

        async def one(spec: TraceRequest, prompt: str | list[int]) -> RequestRecord:
            record = await _send(client, model, spec, prompt, start + spec.arrival_time)
            if on_finish is not None:
                on_finish(record)
            return record

        records = await asyncio.gather(*(one(s, p) for s, p in zip(trace.requests, prompts)))
        after = await _engine_totals(client)
    return HttpRun(list(records), EngineTotals(after.num_steps - before.num_steps,
                                               after.num_preemptions - before.num_preemptions,
                                               after.num_blocks))


async def _check_server(client: httpx.AsyncClient, model: str, policy: str) -> None:
    health = (await client.get("/health")).raise_for_status().json()
    if (health["model"], health["policy"]) != (model, policy):
        raise ValueError(f"the server runs {health['model']} with policy {health['policy']}; "
                         f"pass --model {health['model']} --policy {health['policy']}")


async def _engine_totals(client: httpx.AsyncClient) -> EngineTotals:
    values = parse_metrics((await client.get("/metrics")).raise_for_status().text)
    return EngineTotals(int(values["jserve_engine_steps_total"]),
                        int(values["jserve_preemptions_total"]), int(values["jserve_kv_blocks_total"]))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus samples by name, labels written as in the text format: `name{k="v"}`."""
    def key(name: str, labels: dict[str, str]) -> str:
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return f"{name}{{{inner}}}" if inner else name

    return {key(s.name, s.labels): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url.rstrip('/')}/metrics").raise_for_status().text)


def wait_until_idle(url: str, timeout: float = 20.0) -> bool:
    """Poll `/metrics` until no request runs or waits and every KV block is free (True),
    or `timeout` seconds pass (False): how a test sees that aborted streams freed their
    blocks without reaching into the server."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape_metrics(url)
        if (m["jserve_requests_running"] + m["jserve_requests_waiting"] == 0
                and m["jserve_kv_blocks_free"] == m["jserve_kv_blocks_total"]):
            return True
        time.sleep(0.05)
    return False


async def _send(client: httpx.AsyncClient, model: str, spec: TraceRequest, prompt: str | list[int],
                arrival: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
    params = benchmark_params(spec)
    body = {
        "model": model, "prompt": prompt, "max_tokens": params.max_tokens,
        "temperature": params.temperature, "ignore_eos": params.ignore_eos,
        "ttft_slo": spec.ttft_slo, "tbt_slo": spec.tbt_slo, "return_token_ids": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    token_times: list[float] = []
    finished_time = None
    prompt_len = len(prompt) if isinstance(prompt, list) else spec.prompt_len
    extra = {"num_preemptions": 0, "preempted_time": 0.0}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise ServerRejected(f"request {spec.request_id}: HTTP {resp.status_code} {resp.text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:  # the engine failed mid-stream: the request is lost
                    break
                for choice in chunk["choices"]:
                    token_times += [now] * len(choice["token_ids"])
                    if choice["finish_reason"] is not None:
                        finished_time = now
                extra = chunk.get("jserve", extra)
                if chunk.get("usage"):
                    prompt_len = chunk["usage"]["prompt_tokens"]
    except httpx.TransportError:  # connection lost: counted as unfinished
        finished_time = None
    return RequestRecord(
        request_id=spec.request_id, arrival_time=arrival,
        first_token_time=token_times[0] if token_times else None, finished_time=finished_time,
        token_times=tuple(token_times), prompt_len=prompt_len, output_len=len(token_times),
        num_preemptions=extra["num_preemptions"], preempted_time=extra["preempted_time"],
        ttft_slo=spec.ttft_slo, tbt_slo=spec.tbt_slo, finished=finished_time is not None,
    )
