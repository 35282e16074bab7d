"""The offline, vLLM-style entry point: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jinja2

from jserve.builder import build_engine
from jserve.config import EngineConfig
from jserve.engine.request import Request, RequestOutput
from jserve.engine.sampling_params import SamplingParams
from jserve.errors import InvalidRequestError
from jserve.models.loading import CausalLM, LoadedModel
from jserve.models.registry import DEFAULT_MODEL
from jserve.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jserve.predictor import LengthPredictor

Messages = list[dict[str, str]]


def render_chat(tokenizer: Tokenizer, messages: Messages, add_generation_prompt: bool = True) -> str:
    """The conversation through the model's chat template; `InvalidRequestError` (param
    `messages`) for a malformed message or one the template refuses."""
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InvalidRequestError(f"messages[{i}] must have a string 'role' and 'content', "
                                      f"got {m!r}", "messages")
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt)
    except (jinja2.TemplateError, ValueError) as e:
        raise InvalidRequestError(f"cannot apply the chat template: {e}", "messages") from None


class LLM:
    """Load a model, size its paged KV cache and serve batches of prompts.

    `LLM(model, policy=..., num_blocks=..., ...)`: `model` is a registry name (default
    SmolLM2-135M with its real weights), a Hugging Face checkpoint directory, or a model
    already in memory (a `LoadedModel`, or a Flax model of jserve's families such as
    `PagedModel.bind(params)` from `jserve.models.functional`), and every keyword is an
    `EngineConfig` field (see there: policy, cache size and limits, weights, dtype,
    attention backend, warm-up, swap space, predictor, prefix cache, profile).
    `LLM(EngineConfig(...))` takes a whole configuration, e.g. one read from the command line.
    """

    def __init__(self, model: str | LoadedModel | CausalLM | EngineConfig = DEFAULT_MODEL,
                 **options: Any) -> None:
        if isinstance(model, EngineConfig):
            if options:
                raise TypeError(f"LLM(EngineConfig) takes no other options, got {sorted(options)}")
            config = model
        else:
            config = EngineConfig(model=model, **options)
        if config.runner != "real":
            raise ValueError("LLM runs the model (runner='real'); simulate with `jserve.sim.simulate` "
                             "or `jserve bench --engine sim`")
        built = build_engine(config)
        self.engine_config = config
        self.engine = built.engine
        self.policy = built.engine.policy
        self.runner = built.runner
        self.model = built.loaded
        self.config = built.model_config
        self.tokenizer: Tokenizer | None = built.tokenizer
        self.predictor: LengthPredictor | None = built.predictor  # the engine asks it at admission
        self._ids = itertools.count()

    # ---------------------------------------------------------------- requests
    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{self.config.name} has dummy weights and no tokenizer: pass prompt_token_ids"
            )
        return self.tokenizer

    def _add_all(
        self,
        prompts: str | Sequence[str] | None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        prompt_token_ids: Sequence[Sequence[int]] | None,
    ) -> dict[str, SamplingParams]:
        """Admit every prompt (all or nothing); their ids and settings, in order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of prompts and prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        texts: list[str | None] = list(prompts) if prompts is not None else [None] * len(prompt_token_ids)
        if prompt_token_ids is None:
            for text in texts:
                if not isinstance(text, str):
                    raise InvalidRequestError(f"prompts must be strings, got {type(text).__name__}")
            prompt_token_ids = [self._tokenizer().encode(t) for t in texts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(texts)
        if len(sampling_params) != len(texts):
            raise InvalidRequestError(
                f"got {len(sampling_params)} sampling params for {len(texts)} prompts"
            )
        ids: dict[str, SamplingParams] = {}
        try:
            for text, tokens, params in zip(texts, prompt_token_ids, sampling_params):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, tokens, params, prompt=text)
                ids[request_id] = params
        except InvalidRequestError:
            for request_id in ids:  # all or nothing: the engine keeps serving what it had
                self.engine.abort(request_id)
            raise
        return ids

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs come back in the prompts' order, one per
        prompt: with `n` > 1 (or `best_of`) its `outputs` hold the `n` sequences returned,
        and its flat fields are the first's (`RequestOutput.of_group`)."""
        ids = self._add_all(prompts, sampling_params, prompt_token_ids)
        done: dict[str, list[Request]] = {i: [] for i in ids}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        for req in self._steps():
            if req.finished:
                seqs = done[req.group_request_id]
                seqs.append(req)
                if bar is not None and len(seqs) == ids[req.group_request_id].num_sequences:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [RequestOutput.of_group(done[i], params.n) for i, params in ids.items()]

    def generate_stream(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each sequence's cumulative output after every step it advances in: with
        `n` > 1 each sequence on its own, told apart by `index` (under its prompt's
        `request_id`). With `best_of` > n every sequence generated is yielded."""
        self._add_all(prompts, sampling_params, prompt_token_ids)
        yield from self._run()

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self._tokenizer(), list(c)) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self) -> Iterator[RequestOutput]:
        for req in self._steps():
            yield RequestOutput.of(req)

    def _steps(self) -> Iterator[Request]:
        """Each sequence that advanced, step after step, until everything has ended."""
        while self.engine.has_unfinished:
            yield from self.engine.step()

    @property
    def num_preemptions(self) -> int:
        return self.engine.stats.num_preemptions
