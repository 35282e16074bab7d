"""ShareGPT prompts paired with their true reply lengths, and their cached base features.

An example is what a serving policy would see and what it wants to know: the prompt token
ids of a conversation's first user turn under the model's chat template (exactly what
`LLM.chat` sends to the engine), and the token count of the first assistant reply under
the same tokenizer (what the engine would have to generate).

Prompts are drawn with :func:`jserve.datasets.sharegpt.sample_requests`, i.e. with vLLM's ShareGPT
filter and shuffle, so the predictor learns the length distribution that the `sharegpt`
workload replays. Repeated prompt texts are dropped after their first occurrence: ShareGPT
holds a few percent of verbatim duplicates, and one landing on each side of the split
would leak held-out answers into training. The held-out split is the *first* `num_test`
examples of the seeded shuffle and training takes the ones after, so growing `num_train`
never moves an example from held-out into training.

Encoding with the frozen base is the whole cost of training, so features are kept on disk
per prompt and encoder configuration (`feature_store.py`): a rerun with other head
settings, more training prompts or a resumed run encodes only prompts never seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jserve.datasets.sharegpt import Conversation, sample_requests
from jserve.predictor.encoder import PromptEncoder
from jserve.predictor.feature_store import FeatureStore
from jserve.models.tokenizer import Tokenizer

__all__ = ["LengthDataset", "LengthExample", "build_dataset", "cached_features", "chat_prompt_ids"]


@dataclass(frozen=True)
class LengthExample:
    """One prompt (chat-templated token ids, untruncated) and its true reply length in tokens."""

    conversation_id: str
    prompt_ids: tuple[int, ...]
    output_len: int


@dataclass(frozen=True)
class LengthDataset:
    """The deterministic train / held-out split of one seed."""

    train: tuple[LengthExample, ...]
    test: tuple[LengthExample, ...]


def chat_prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of one user message under the chat template, as `LLM.chat` would send it."""
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def build_dataset(
    tokenizer: Tokenizer,
    num_train: int,
    num_test: int,
    seed: int = 0,
    *,
    conversations: Sequence[Conversation] | None = None,
) -> LengthDataset:
    """Sample `num_test` held-out then `num_train` training examples (see the module doc).

    Dropping repeated prompts can leave a split a few examples short of what was asked;
    callers report the actual sizes.
    """
    if num_train < 1 or num_test < 1:
        raise ValueError(f"num_train and num_test must be >= 1, got {num_train} and {num_test}")
    sampled = sample_requests(tokenizer.encode, num_train + num_test, seed=seed,
                              conversations=conversations)
    seen: set[str] = set()
    examples = []
    for req in sampled:
        if req.prompt in seen:
            continue
        seen.add(req.prompt)
        examples.append(LengthExample(req.conversation_id,
                                      tuple(chat_prompt_ids(tokenizer, req.prompt)), req.output_len))
    return LengthDataset(train=tuple(examples[num_test:]), test=tuple(examples[:num_test]))


def cached_features(encoder: PromptEncoder, examples: Sequence[LengthExample],
                    cache_dir: Path | None = None, progress: bool = False) -> np.ndarray:
    """The encoder's features `[N, F]` of `examples`, each prompt encoded once and kept on
    disk (`cache_dir`: default `feature_store.default_cache_dir()`)."""
    return FeatureStore.of(encoder.config, cache_dir).features(
        encoder, [ex.prompt_ids for ex in examples], progress)
