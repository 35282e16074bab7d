"""The OpenAI-compatible server over real loopback HTTP: the official `openai` client
(streaming and not), error JSON, a mid-stream disconnect that must free its blocks,
per-request SLOs reaching the policy, and the benchmark's HTTP backend."""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from conftest import SMOL_ENGINE
from jserve import LLM, SamplingParams
from jserve.benchmarking.bench import BenchConfig, run_benchmark
from jserve.benchmarking.http_client import scrape_metrics
from jserve.benchmarking.http_client import wait_until_idle as server_idle
from jserve.cache.prefix import PrefixCacheConfig
from jserve.cli import main
from jserve.config import EngineConfig, ServerConfig
from jserve.engine.plan import Plan
from jserve.engine.policy import PolicyCapabilities
from jserve.engine.view import SchedulerView
from jserve.policies.vllm import VLLMPolicy
from jserve.predictor import Prediction
from jserve.serving.server import build_app, serve_in_background
from jserve.models.loading import LoadedModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_CONTEXT = 1024
NO_EOS = {"ignore_eos": True, "return_token_ids": True}
ABORTED = 'jserve_requests_finished_total{finish_reason="abort"}'
HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class SloRecordingPolicy:
    """vLLM's schedule, noting the SLO and prediction columns it is shown (test-only state).
    It names a predictor kind, so the engine asks the `LLM`'s predictor about every request."""

    name: str = "vllm"
    chunked_prefill: bool = False
    inner: VLLMPolicy = field(default_factory=VLLMPolicy)
    seen: set[tuple[float, float]] = field(default_factory=set)
    predictions: set[tuple[int, int, int]] = field(default_factory=set)  # (prompt, length, dir)
    capabilities: PolicyCapabilities = PolicyCapabilities(predictor_kind="cacheopt")

    def schedule(self, view: SchedulerView) -> Plan:
        r = view.requests
        self.seen |= {(a, b) for a, b in zip(r.ttft_slo.tolist(), r.tbt_slo.tolist())
                      if not math.isnan(a)}
        self.predictions |= set(zip(r.prompt_len.tolist(), r.predicted_len.tolist(),
                                    r.predicted_dir.tolist()))
        return self.inner.schedule(view)


class PromptLengthPredictor:
    """Predicts prompt length + 3 tokens, expecting an over-prediction: easy to recognise."""

    def predict_batch(self, prompts: list[list[int]]) -> list[Prediction]:
        return [Prediction(len(p) + 3, over_prob=0.9) for p in prompts]


@dataclass
class Served:
    url: str
    llm: LLM
    client: openai.OpenAI


def _serve(llm: LLM, config: ServerConfig | None = None) -> Iterator[Served]:
    with serve_in_background(build_app(llm, config)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield Served(url, llm, client)
        client.close()


@pytest.fixture(scope="module")
def tiny(tiny_loaded: LoadedModel) -> Iterator[Served]:
    """tiny-llama (random weights, no tokenizer): prompts are token ids."""
    llm = LLM(tiny_loaded, policy=SloRecordingPolicy(), num_blocks=128, max_model_len=TINY_CONTEXT,
              max_num_seqs=8, max_num_batched_tokens=TINY_CONTEXT, warmup=False,
              predictor=PromptLengthPredictor())
    yield from _serve(llm)


@pytest.fixture(scope="module")
def smol(tiny_smollm2_vocab: LoadedModel) -> Iterator[Served]:
    """SmolLM2's tokenizer and chat template (over a two-layer model of random weights: these
    tests check the HTTP layer's text, not the model's answers), for text prompts and chat,
    served under SmolLM2's registry name and its Hugging Face id."""
    llm = LLM(tiny_smollm2_vocab, warmup=False, **SMOL_ENGINE)
    yield from _serve(llm, ServerConfig(served_model_names=("smollm2-135m", HF_ID)))


def wait_until_idle(served: Served) -> None:
    """No request left and every block free, as /metrics and the engine itself say."""
    assert server_idle(served.url), "the server still holds requests or blocks"
    state = served.llm.engine.state
    assert not state.has_unfinished and state.blocks.num_free == state.blocks.num_blocks
    state.check_invariants()


# ------------------------------------------------------------------ token-id prompts


def test_models_and_health(tiny: Served) -> None:
    [model] = tiny.client.models.list().data
    assert model.id == "tiny-llama" and model.owned_by == "jserve"
    assert httpx.get(f"{tiny.url}/health").json() == {"status": "ok", "model": "tiny-llama",
                                                     "policy": "vllm"}


def test_completion_streamed_equals_non_streamed(tiny: Served) -> None:
    kw = dict(model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, extra_body=NO_EOS)
    full = tiny.client.completions.create(**kw)
    [choice] = full.choices
    assert choice.finish_reason == "length" and len(choice.token_ids) == 6
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (4, 6)

    chunks = list(tiny.client.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    *token_chunks, usage_chunk = chunks
    assert [t for c in token_chunks for t in c.choices[0].token_ids] == choice.token_ids
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert token_chunks[-1].jserve == {"num_preemptions": 0, "preempted_time": 0.0}
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 6
    wait_until_idle(tiny)


def test_disconnect_mid_stream_aborts_and_frees_blocks(tiny: Served) -> None:
    aborted = scrape_metrics(tiny.url).get(ABORTED, 0)
    stream = tiny.client.completions.create(model="tiny-llama", prompt=[1, 2, 3],
                                            max_tokens=TINY_CONTEXT - 3, stream=True, extra_body=NO_EOS)
    for _, chunk in zip(range(2), stream):
        assert chunk.choices[0].finish_reason is None
    stream.close()
    wait_until_idle(tiny)
    assert scrape_metrics(tiny.url)[ABORTED] == aborted + 1


def test_disconnect_before_a_non_streamed_answer_aborts_and_frees_blocks(
        tiny: Served, caplog: pytest.LogCaptureFixture) -> None:
    """A client that gives up on a non-streaming request (a timeout; the openai client then
    retries) leaves nothing running: each abandoned copy is aborted, and no handler fails."""
    caplog.set_level(logging.INFO, logger="jserve.serving.server")
    aborted = scrape_metrics(tiny.url).get(ABORTED, 0)
    client = tiny.client.with_options(timeout=0.5, max_retries=1)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=TINY_CONTEXT - 3,
                                  extra_body=NO_EOS)
    wait_until_idle(tiny)
    assert scrape_metrics(tiny.url)[ABORTED] == aborted + 2
    gone = [r for r in caplog.records if "disconnected; request aborted" in r.getMessage()]
    assert len(gone) == 2 and not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        (b'{"model": "tiny-llama", "prompt": [1, 2', 400, None, "malformed JSON body"),
        (b'{"model": "tiny-llama"}', 400, "prompt", "prompt: Field required"),
        (b'{"model": "gpt-4", "prompt": [1]}', 404, "model", "The model `gpt-4` does not exist"),
        (b'{"model": "tiny-llama", "prompt": [1], "max_tokens": 0}', 400, "max_tokens", "max_tokens must be"),
        (b'{"model": "tiny-llama", "prompt": [1], "n": 0}', 400, "n", "n must be an integer >= 1"),
        (b'{"model": "tiny-llama", "prompt": [1], "tbt_slo": -1}', 400, "tbt_slo",
         "tbt_slo must be a positive number"),
        (b'{"model": "tiny-llama", "prompt": [1, 2, 99999]}', 400, "prompt", "prompt token ids must lie in"),
        (json.dumps({"model": "tiny-llama", "prompt": [1] * TINY_CONTEXT}).encode(), 400, "prompt",
         "the context limit is 1024"),
        (b'{"model": "tiny-llama", "prompt": "text"}', 400, "prompt", "no tokenizer"),
        (b'{"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 1000000000}', 400, "max_tokens",
         "maximum context length is 1024 tokens. However, you requested 1000000002 tokens "
         "(2 in the prompt, 1000000000 in the completion)"),
        (b'{"model": "tiny-llama", "prompt": [1], "temperature": Infinity}', 400, "temperature",
         "temperature must be a finite number"),
        (b'{"model": "tiny-llama", "prompt": [1], "top_p": NaN}', 400, "top_p", "top_p must be a finite number"),
        (b'{"model": "tiny-llama", "prompt": [1], "stream": "yes"}', 400, "stream",
         "stream: Input should be a valid boolean"),
        (b'{"model": "tiny-llama", "prompt": [1], "echo": 1}', 400, "echo", "echo: Input should be a valid boolean"),
        (b'{"model": "tiny-llama", "prompt": 42}', 400, "prompt",
         "prompt: must be a string, a list of token ids, or a list of either (a batch)"),
        (b'{"model": "tiny-llama", "prompt": [1], "stop": 7}', 400, "stop", "stop: must be a string or a list"),
        (b'{"model": "tiny-llama", "prompt": [[1, 2], []]}', 400, "prompt", "prompt[1]: the prompt is empty"),
    ],
)
def test_bad_completion_requests_get_openai_errors(tiny: Served, body: bytes, status: int,
                                                   param: str | None, message: str) -> None:
    r = httpx.post(f"{tiny.url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert message in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param


def test_chat_max_tokens_over_the_context_names_max_completion_tokens(smol: Served) -> None:
    r = httpx.post(f"{smol.url}/v1/chat/completions", json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 10_000})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_completion_tokens" and "in the messages, 10000 in the completion" in err["message"]


def test_bad_chat_requests_and_client_exceptions(tiny: Served) -> None:
    r = httpx.post(f"{tiny.url}/v1/chat/completions", json={"model": "tiny-llama"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        tiny.client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError) as missing:
        tiny.client.completions.create(model="gpt-4", prompt=[1])
    assert missing.value.code == "model_not_found"


def test_server_keeps_serving_after_errors(tiny: Served) -> None:
    out = tiny.client.completions.create(model="tiny-llama", prompt=[9, 9], max_tokens=3, extra_body=NO_EOS)
    assert out.usage.completion_tokens == 3
    wait_until_idle(tiny)


# ------------------------------------------------------------------ SLOs and the HTTP benchmark


def test_http_bench_replays_a_trace_and_slos_reach_the_policy(tiny: Served, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--backend", "http", "--url", tiny.url, "--model", "tiny-llama",
                 "--workload", "fixed:12:5", "--num-requests", "6", "--rate", "100",
                 "--ttft-slo", "2", "--tbt-slo", "0.5", "--slo-scale", "0.5", "2.5",
                 "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["backend"] == "http" and data["summary"]["num_finished"] == 6
    records = data["requests"]
    assert all(r["output_len"] == 5 and r["prompt_len"] == 12 and len(r["token_times"]) == 5
               for r in records)
    assert data["num_steps"] > 0 and data["num_blocks"] == 128
    assert {(r["ttft_slo"], r["tbt_slo"]) for r in records} <= tiny.llm.policy.seen
    wait_until_idle(tiny)


def test_predictions_reach_the_policy(tiny: Served) -> None:
    """The server's predictor reaches the policy where the request leaves its length open
    (EOS allowed, max_tokens above the guess); a request with ignore_eos and a max_tokens
    that fits tells its length, which comes before any guess."""
    tiny.client.completions.create(model="tiny-llama", prompt=[5, 6, 7, 8, 9, 10, 11],
                                   max_tokens=16)
    assert (7, 10, 1) in tiny.llm.policy.predictions
    tiny.client.completions.create(model="tiny-llama", prompt=[5, 6, 7, 8, 9, 10, 11, 12],
                                   max_tokens=2, extra_body=NO_EOS)
    assert (8, 2, 0) in tiny.llm.policy.predictions
    wait_until_idle(tiny)


def test_prefix_cache_reuses_a_conversations_history_over_http(tiny_loaded: LoadedModel) -> None:
    """With caches isolated per conversation, a turn reuses its own conversation's history
    and not another's; usage reports the cached prompt tokens as OpenAI does."""
    llm = LLM(tiny_loaded, num_blocks=64, block_size=4, max_model_len=TINY_CONTEXT, warmup=False,
              prefix_cache=PrefixCacheConfig(isolation=True))
    with serve_in_background(build_app(llm)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def cached(conversation: str) -> int:
            out = client.completions.create(model="tiny-llama", prompt=list(range(5, 18)), max_tokens=2,
                                            extra_body=NO_EOS | {"conversation_id": conversation})
            return out.usage.prompt_tokens_details.cached_tokens

        assert cached("a") == 0
        assert cached("a") == 12  # three full blocks of the 13 prompt tokens
        assert cached("b") == 0
        client.close()


def test_http_bench_refuses_a_server_running_another_policy(tiny: Served) -> None:
    cfg = BenchConfig(EngineConfig(model="tiny-llama", policy="sarathi"), backend="http",
                      url=tiny.url, workload="fixed:4:2", num_requests=1)
    with pytest.raises(ValueError, match="pass --model tiny-llama --policy vllm"):
        run_benchmark(cfg, progress=False)


# ------------------------------------------------------------------ text and chat (SmolLM2)


def test_chat_streamed_equals_non_streamed(smol: Served) -> None:
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Say hello."}],
              max_tokens=8, temperature=0)
    full = smol.client.chat.completions.create(**kw)
    [choice] = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and full.usage.prompt_tokens > 10

    chunks = list(smol.client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    wait_until_idle(smol)


def test_text_completion_stops_at_a_stop_string(smol: Served) -> None:
    """The text ends where the stop string first starts, streamed or not: the stop string is
    two characters of the model's own unstopped answer. (SmolLM2 stopping its real answer
    is test_engine_greedy's.)"""
    kw = dict(model="smollm2-135m", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    free = smol.client.completions.create(**kw).choices[0].text
    stop = free[2:4]
    assert len(stop) == 2
    out = smol.client.completions.create(**kw, stop=[stop])
    assert out.choices[0].text == free[:free.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = smol.client.completions.create(**kw, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == free[:free.index(stop)]


# ------------------------------------------------------------------ the load test


@pytest.mark.slow
def test_http_load_script_passes(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "load.json"
    env = os.environ | {"PYTHONPATH": str(ROOT)}  # this checkout's jserve, installed or not
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "http_load.py"), "--output", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["passed"]


# ------------------------------------------------------------------ logprobs

# Two runs of one request may take different step programs (token buckets, batch rows), whose
# float32 sums round apart in the last bits: 1.2e-6 at a log-probability of -2.58 was seen.
LOGPROB_TOL = 1e-5


def test_completion_logprobs_and_echo_in_openais_shape(tiny: Served) -> None:
    prompt = [5, 6, 7, 8]
    kw = dict(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True,
              extra_body=NO_EOS)
    full = tiny.client.completions.create(**kw)
    lp = full.choices[0].logprobs
    reference = LLM(tiny.llm.model, num_blocks=16, max_model_len=64, warmup=False)  # never the served one
    [ref] = reference.generate(prompt_token_ids=[prompt], use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3))
    assert lp.tokens == [f"token_id:{t}" for t in prompt + ref.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [ref.prompt_logprobs[p][t] for p, t in enumerate(prompt) if p] + ref.logprobs
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=LOGPROB_TOL)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [0] * len(lp.tokens)  # no tokenizer: the tokens have no text

    chunks = list(tiny.client.completions.create(**kw, stream=True))
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(expected, abs=LOGPROB_TOL)
    plain = tiny.client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, extra_body=NO_EOS)
    assert plain.choices[0].logprobs is None
    wait_until_idle(tiny)


def test_chat_logprobs_and_top_logprobs(smol: Served) -> None:
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Say hello."}],
              max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    full = smol.client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert "".join(c.token for c in content) == full.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
               and c.bytes == list(c.token.encode()) for c in content)
    streamed = [c for chunk in smol.client.chat.completions.create(**kw, stream=True)
                for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=LOGPROB_TOL)
    r = httpx.post(f"{smol.url}/v1/chat/completions", json=kw | {"logprobs": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    wait_until_idle(smol)


# ------------------------------------------------------------------ what third-party clients need


def test_a_batch_of_token_id_prompts_gets_one_choice_each_in_order(tiny: Served) -> None:
    prompts = [[5, 6, 7], [9], [11, 12, 13, 14]]
    kw = dict(model="tiny-llama", max_tokens=3, temperature=0, extra_body=NO_EOS)
    alone = [tiny.client.completions.create(prompt=p, **kw).choices[0].token_ids for p in prompts]
    batch = tiny.client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.token_ids for c in batch.choices] == alone
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (8, 9)
    chunks = list(tiny.client.completions.create(prompt=prompts, stream=True, **kw,
                                                 stream_options={"include_usage": True}))
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in chunks[:-1]:
        [c] = chunk.choices
        streamed[c.index] += c.token_ids
    assert list(streamed.values()) == alone and chunks[-1].usage.completion_tokens == 9
    wait_until_idle(tiny)


def test_a_text_batch_matches_its_prompts_sent_alone(smol: Served) -> None:
    prompts = ["1, 2, 3,", "The capital of France is"]
    kw = dict(model="smollm2-135m", max_tokens=4, temperature=0)
    alone = [smol.client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    batch = smol.client.completions.create(prompt=prompts, **kw)
    assert [(c.index, c.text) for c in batch.choices] == list(enumerate(alone))
    wait_until_idle(smol)


def _joined(lp: object) -> str:
    return "".join(lp.tokens)


def test_scoring_echoes_the_prompts_logprobs_and_generates_nothing(smol: Served) -> None:
    """`max_tokens: 0` with `echo` (lm-eval's loglikelihood): the prompt's log-probabilities,
    the same as a one-token run's, and no completion."""
    kw = dict(model="smollm2-135m", prompt="The quick brown fox jumps", echo=True, logprobs=1, temperature=0)
    scored = smol.client.completions.create(max_tokens=0, **kw)
    [c] = scored.choices
    one = smol.client.completions.create(max_tokens=1, **kw).choices[0].logprobs
    assert c.text == "The quick brown fox jumps" and c.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and len(c.logprobs.tokens) == scored.usage.prompt_tokens
    assert c.logprobs.tokens == one.tokens[:-1] and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(one.token_logprobs[1:-1], abs=1e-5)
    r = httpx.post(f"{smol.url}/v1/completions", json={"model": "smollm2-135m", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    wait_until_idle(smol)


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_count_characters_where_tokens_split_them(smol: Served, stream: bool) -> None:
    """Byte-level tokens split `日` and emoji: each token's text is its share of the text
    (empty until a character is whole), so the tokens join back into the text and each
    offset is the characters before it, as OpenAI defines `text_offset`."""
    prompt = "日本語のテキスト 🤗👍🏽"
    out = smol.client.completions.create(model="smollm2-135m", prompt=prompt, echo=True, logprobs=2,
                                         max_tokens=6, temperature=0, stream=stream)
    chunks = [c.choices[0] for c in out] if stream else out.choices
    text = "".join(c.text for c in chunks)
    tokens = [t for c in chunks for t in c.logprobs.tokens]
    offsets = [o for c in chunks for o in c.logprobs.text_offset]
    assert text.startswith(prompt) and "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert len(tokens) > len(prompt)  # more tokens than characters: some split one
    wait_until_idle(smol)


def test_served_model_names_are_all_listed_and_all_answer(smol: Served) -> None:
    assert [m.id for m in smol.client.models.list().data] == ["smollm2-135m", HF_ID]
    out = smol.client.completions.create(model=HF_ID, prompt="Hi", max_tokens=1, temperature=0)
    assert out.model == HF_ID and out.usage.completion_tokens == 1
    with pytest.raises(openai.NotFoundError, match=f"serves `smollm2-135m`, `{HF_ID}`"):
        smol.client.completions.create(model="gpt-4", prompt="Hi")
    wait_until_idle(smol)


def test_vllms_tokenizer_routes(smol: Served) -> None:
    """/tokenize, /detokenize and /tokenizer_info in vLLM's shapes: what lm-eval's remote
    tokenizer reads (its eos id is the encoding of `eos_token`)."""
    tok = smol.llm.tokenizer
    r = httpx.post(f"{smol.url}/tokenize", json={"prompt": "Hello 日本", "return_token_strs": True,
                                                 "add_special_tokens": False}).json()
    assert r == {"count": 5, "max_model_len": 256, "tokens": tok.encode("Hello 日本"),
                 "token_strs": ["Hello", "Ġæ", "Ĺ", "¥", "æľ¬"]}
    chat = httpx.post(f"{smol.url}/tokenize", json={"model": HF_ID, "messages": [
        {"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    assert httpx.post(f"{smol.url}/detokenize", json={"tokens": chat["tokens"]}).json() == {
        "prompt": tok.apply_chat_template([{"role": "user", "content": "Hi"}])}
    info = httpx.get(f"{smol.url}/tokenizer_info").json()
    assert (info["tokenizer_class"], info["eos_token"], info["model_max_length"]) == (
        "PreTrainedTokenizerFast", "<|im_end|>", 256)
    assert tok.encode(info["eos_token"]) == [tok.eos_token_id] and "<|im_start|>" in info["chat_template"]
    for path, body, param in [("/tokenize", {}, None), ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens")]:
        r = httpx.post(f"{smol.url}{path}", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param
