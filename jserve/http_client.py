"""Talking to a running `jserve serve` from outside: reading its `/metrics`."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


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
