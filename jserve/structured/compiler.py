"""Compiling a `GrammarSpec` with llguidance for one tokenizer.

llguidance builds its token table from the tokenizer's Hugging Face JSON (about 0.4 s for
SmolLM2's 49,152 tokens), so a `GrammarCompiler` builds it once, on the first grammar, and
keeps each spec's compiled matcher: a request gets a copy of it (`deep_copy`), not a
second compilation."""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict

import llguidance

from jserve.models.tokenizer import Tokenizer
from jserve.structured.matcher import GrammarMatcher
from jserve.structured.spec import GrammarSpec

# JSON as one line with a space after `,` and `:`: llguidance's default lets whitespace run
# on between any two tokens, which a model (a random one in tests, a weak one anywhere) can
# fill until max_tokens without ever closing the object. A schema's own `x-guidance`
# options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 256  # compiled specs a compiler keeps, least recently used dropped first


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for `spec`."""
    return llguidance.LLMatcher.grammar_from_json_schema(spec.schema, defaults=JSON_OPTIONS)


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def check_grammar(spec: GrammarSpec) -> str:
    """Why `spec` cannot be compiled (a schema keyword llguidance does not implement, an
    invalid schema), or "" if it can: checked without a tokenizer, so a front end refuses
    a request before it reaches an engine."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(spec))
    return messages[0] if failed else ""


class GrammarCompiler:
    """The matchers of one tokenizer's requests. `vocab_size`: the model's logits per row,
    which may exceed the tokenizer's tokens (a padded embedding); the extra ids are never
    allowed. Thread-safe: the server admits requests from the engine loop's thread, and
    tests from their own."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._table: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for one request's output; `ValueError` if the grammar does not
        compile (`check_grammar` says why before it gets here)."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is None:
                compiled = llguidance.LLMatcher(self._token_table(), grammar_text(spec), log_level=0)
                if compiled.is_error():
                    raise ValueError(f"the grammar does not compile: {compiled.get_error()}")
                self._compiled[spec] = compiled
                if len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(spec)
            return GrammarMatcher(compiled.deep_copy(), self.vocab_size)

    def _token_table(self) -> llguidance.LLTokenizer:
        if self._table is None:
            self._table = llguidance.LLTokenizer(self._tokenizer.hf_json(), n_vocab=self.vocab_size,
                                                 eos_token=self._tokenizer.eos_token_id)
        return self._table


_COMPILERS: weakref.WeakKeyDictionary[Tokenizer, dict[int, GrammarCompiler]] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
    """The one compiler of a tokenizer and vocabulary: engines over the same model (the
    tests build many) share its token table and compiled grammars."""
    with _COMPILERS_LOCK:
        by_vocab = _COMPILERS.setdefault(tokenizer, {})
        if vocab_size not in by_vocab:
            by_vocab[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return by_vocab[vocab_size]
