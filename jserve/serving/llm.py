"""The offline, vLLM-style entry point: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jserve.cache.prefix import PrefixCacheConfig
from jserve.cache.sizing import device_kv_budget, dtype_bytes, num_blocks_for_budget
from jserve.engine.loop import Engine
from jserve.engine.request import RequestOutput
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.state import EngineState
from jserve.engine.view import SchedulerLimits
from jserve.errors import InvalidRequestError
from jserve.policies import Policy, make_policy
from jserve.policies.tail_optimized_lru import eviction_rule_for
from jserve.runners.jax_runner import JaxRunner
from models.loading import LoadedModel, Weights, load_model
from models.registry import DEFAULT_MODEL
from models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jserve.predictor import LengthPredictor

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]


def enable_compilation_cache() -> None:
    """Keep compiled steps on disk so the second start-up skips XLA compilation: all of them,
    not only those over JAX's default 1 s of compiling (a small model's buckets, such as
    tiny-llama's, each compile in under a second and were rebuilt at every start)."""
    if jax.config.jax_compilation_cache_dir is None:
        path = os.environ.get("JSERVE_COMPILE_CACHE", os.path.expanduser("~/.cache/jserve/xla"))
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class LLM:
    """Load a model, size its paged KV cache and serve batches of prompts.

    Args:
        model: a name from `models.registry` (default SmolLM2-135M with its real weights), or
            a `LoadedModel` already in memory (several engines can share one).
        policy: scheduling/KV policy name (`jserve.policies.POLICIES`) or a policy object
            (e.g. `SarathiPolicy(token_budget=256)`).
        num_blocks: KV blocks in the cache; None sizes it from memory (a test can force a
            tiny cache to provoke preemptions).
        block_size: tokens per KV block.
        max_model_len: prompt + output cap; default min(model context, 2048).
        max_num_seqs / max_num_batched_tokens: per-step limits (vLLM's meaning).
        weights: 'auto' (real where shipped, else random), 'real' or 'dummy'.
        dtype: 'auto' (float32 on CPU, bfloat16 on accelerators) or a jnp dtype name.
        attention: attention backend: 'auto' (Pallas kernels on GPU, jnp reference on CPU),
            'reference', 'pallas', or 'pallas-interpret' (the kernels interpreted, for checking).
        warmup: compile the step's shape buckets now rather than on first use.
        swap_space: GiB of host memory for K/V of requests preempted by swapping (vLLM's
            option and default); 0 leaves policies recompute preemption only.
        predictor: output-length predictor for policies that allocate by prediction
            (cacheopt, rlp, s3): 'auto' loads the shipped one of the policy's kind when it
            reads this model's tokens (it encodes prompts with SmolLM2), None gives the
            policy no predictions (it then reserves each request's maximum length), or a
            `LengthPredictor`.
        prefix_cache: keep finished requests' full KV blocks and reuse them for prompts
            that start the same way: an eviction rule's name ('lru', 'threshold-lru',
            'tlru'; see `jserve.policies.tail_optimized_lru`) or a `PrefixCacheConfig`
            (capacity, per-conversation isolation, T-LRU's threshold). None: off. Outputs
            are the same with it on or off; only the prefill work shrinks.
    """

    def __init__(
        self,
        model: str | LoadedModel = DEFAULT_MODEL,
        policy: str | Policy = "vllm",
        num_blocks: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        weights: Weights = "auto",
        dtype: str = "auto",
        attention: str = "auto",
        warmup: bool = True,
        seed: int = 0,
        swap_space: float = 4.0,
        predictor: str | None | LengthPredictor = "auto",
        prefix_cache: str | PrefixCacheConfig | None = None,
    ) -> None:
        enable_compilation_cache()
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        cache = PrefixCacheConfig(prefix_cache) if isinstance(prefix_cache, str) else prefix_cache
        if dtype == "auto":
            dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        if isinstance(model, LoadedModel):
            loaded = model
            dtype = loaded.model.embed.embedding.get_value().dtype
        else:
            loaded = load_model(model, weights=weights, dtype=jnp.dtype(dtype), seed=seed)
        self.model = loaded
        self.config = loaded.config
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        max_model_len = max_model_len or min(self.config.max_position, 2048)
        limits = SchedulerLimits.with_default_budget(max_num_seqs, max_num_batched_tokens, max_model_len)
        if num_blocks is None:
            weight_bytes = self.config.num_params * dtype_bytes(dtype)
            budget = device_kv_budget(weight_bytes)
            num_blocks = num_blocks_for_budget(self.config, block_size, dtype_bytes(dtype), budget)
        if num_blocks < 1:
            raise ValueError("no memory is left for the KV cache; pass num_blocks explicitly")
        state = EngineState(
            num_blocks=num_blocks, block_size=block_size, limits=limits,
            eos_token_id=self.config.eos_token_id, vocab_size=self.config.vocab_size,
            tokenizer=self.tokenizer, chunked_prefill=self.policy.chunked_prefill,
            num_host_blocks=num_blocks_for_budget(self.config, block_size, dtype_bytes(dtype),
                                                  swap_space * 2**30),
            **(cache.state_options(block_size) if cache else {}),
        )
        self.runner = JaxRunner(
            loaded.model, num_blocks=num_blocks, block_size=block_size,
            max_num_batched_tokens=limits.max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, attention=attention,
        )
        self.engine = Engine(state, self.policy, self.runner,
                             eviction=eviction_rule_for(cache) if cache else None)
        self.predictor = self._predictor(predictor)
        self._ids = itertools.count()
        if warmup:
            self.runner.warmup(progress=True)

    # ---------------------------------------------------------------- requests
    def _predictor(self, choice: str | None | LengthPredictor) -> LengthPredictor | None:
        kind = getattr(self.policy, "predictor_kind", None)
        if choice is None or kind is None:
            return None
        if choice != "auto":
            return choice
        from jserve.predictor import LengthPredictor

        if self.tokenizer is None or self.config.name != LengthPredictor.base_model():
            log.warning("policy %s allocates by predicted length, but the shipped predictor "
                        "reads %s's tokens, not %s's: requests get no prediction",
                        self.policy.name, LengthPredictor.base_model(), self.config.name)
            return None
        return LengthPredictor.load(kind, base=self.model)

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
    ) -> list[str]:
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
        if self.predictor is None:
            predictions = [(0, 0)] * len(texts)
        else:
            predictions = [p.columns for p in self.predictor.predict_batch(prompt_token_ids)]
        ids: list[str] = []
        try:
            for text, tokens, params, (length, direction) in zip(
                    texts, prompt_token_ids, sampling_params, predictions):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, tokens, params, prompt=text,
                                        predicted_len=length, predicted_dir=direction)
                ids.append(request_id)
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
        """Run the prompts to completion; outputs come back in the prompts' order."""
        ids = self._add_all(prompts, sampling_params, prompt_token_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        for out in self._run():
            if out.finished:
                done[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

    def generate_stream(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's cumulative output after every step it advances in."""
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
        prompts = [self._tokenizer().apply_chat_template(list(c)) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished:
            for req in self.engine.step():
                yield RequestOutput.of(req)

    @property
    def num_preemptions(self) -> int:
        return self.engine.stats.num_preemptions
