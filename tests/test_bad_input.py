"""Errors a user can cause get a clear message, and the engine keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from jserve import LLM, InvalidRequestError, SamplingParams
from jserve.cli import main
from jserve.models.loading import LoadedModel


@pytest.fixture(scope="module")
def llm(tiny_loaded: LoadedModel) -> LLM:
    return LLM(tiny_loaded, num_blocks=32, max_model_len=64, warmup=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(top_p=float("nan")), "top_p must be a finite number"),
        (dict(max_tokens=2.5), "max_tokens must be an integer >= 1"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(stop=[""]), "stop strings must be non-empty"),
    ],
)
def test_bad_sampling_values(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace("]", r"\]")) as e:
        SamplingParams(**kwargs)
    assert e.value.param == next(iter(kwargs))  # the field, as the HTTP error's `param`


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt is empty"),
        (list(range(1, 80)), "the context limit is 64"),
        ([1, 2, 100000], r"prompt token ids must lie in \[0, 512\)"),
    ],
)
def test_bad_prompts_rejected_and_engine_keeps_serving(llm: LLM, prompt: list[int], message: str) -> None:
    ok = [3, 4, 5]
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompt_token_ids=[ok, prompt], sampling_params=SamplingParams(max_tokens=2),
                     use_tqdm=False)
    state = llm.engine.state
    assert not state.has_unfinished, "a rejected batch must leave nothing queued"
    [out] = llm.generate(prompt_token_ids=[ok], sampling_params=SamplingParams(max_tokens=3),
                         use_tqdm=False)
    assert len(out.token_ids) == 3
    assert state.blocks.num_free == state.blocks.num_blocks
    state.check_invariants()


def test_unknown_model_and_policy() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt-17'; known models: .*smollm2-135m"):
        LLM("gpt-17")
    with pytest.raises(ValueError, match="unknown policy .fifo.; known policies: apt-serve, .*cacheopt, .*fastgen, layerkv, layerkv-whole, layerkv/SLO, rlp, s3, sarathi, vllm"):
        LLM("tiny-llama", policy="fifo")


def test_text_prompt_without_tokenizer(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="dummy weights and no tokenizer"):
        llm.generate("hello", use_tqdm=False)


def test_context_cap_finishes_with_length(llm: LLM) -> None:
    [out] = llm.generate(prompt_token_ids=[list(range(1, 61))],
                         sampling_params=SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_slos_reach_the_view_and_bad_ones_are_refused(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="ttft_slo must be a positive number"):
        engine.add_request("bad", [1, 2], SamplingParams(), ttft_slo=0.0)
    engine.add_request("slo", [1, 2], SamplingParams(), ttft_slo=0.5, tbt_slo=0.05)
    engine.add_request("none", [1, 2], SamplingParams())
    r = engine.state.snapshot(0.0).requests
    assert r.ttft_slo[0] == 0.5 and r.tbt_slo[0] == 0.05 and np.isnan(r.ttft_slo[1:]).all()
    for request_id in ("slo", "none"):
        engine.abort(request_id)
    assert not engine.state.has_unfinished


def test_chat_with_a_malformed_message_names_messages(tiny_smollm2_vocab: LoadedModel) -> None:
    llm = LLM(tiny_smollm2_vocab, num_blocks=8, max_model_len=64, warmup=False)
    with pytest.raises(InvalidRequestError, match=r"messages\[0\] must have a string 'role'") as e:
        llm.chat([{"content": "x"}], use_tqdm=False)
    assert e.value.param == "messages"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--rate", "0"], "error: rate must be > 0"),
        (["bench", "--workload", "nosuch"], "error: unknown workload 'nosuch'"),
        (["bench", "--workload", "fixed:abc"], "error: malformed fixed workload 'fixed:abc'"),
        (["bench", "--max-num-seqs", "0"], "error: max_num_seqs must be an int >= 1"),
        (["bench", "--slo-scale", "2", "1"], "error: slo_scale must satisfy"),
        (["sweep", "--rates", "1,0"], "error: rate must be > 0"),
        (["generate", "hi", "--xla-cpu-cores", "0"], "error: --xla-cpu-cores must be between 1 and"),
    ],
)
def test_cli_reports_bad_arguments_in_one_line(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and err.startswith(message)


def test_cli_reports_too_few_devices_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Found only while the engine is built (after the 'loading' line), still no traceback."""
    # 2 splits tiny-llama's heads (a size that does not is refused before: test_loose_checks)
    argv = ["generate", "--model", "tiny-llama", "--no-warmup", "--tensor-parallel-size", "2", "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: tensor_parallel_size=2 needs that many JAX devices")
