"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a tool call),
compiled by llguidance for a tokenizer, and the per-request matcher whose token bitmask
the runner applies to the logits and which advances by each token the engine commits.

This layer sits below the engine: it knows tokenizers and grammars, nothing of requests,
batches or the server."""

from jserve.structured.compiler import GrammarCompiler, check_grammar, compiler_for
from jserve.structured.matcher import GrammarMatcher, bitmask_words, fill_bitmasks
from jserve.structured.spec import GrammarKind, GrammarSpec, ToolCall, ToolDef

__all__ = ["GrammarCompiler", "GrammarKind", "GrammarMatcher", "GrammarSpec", "ToolCall", "ToolDef",
           "bitmask_words", "check_grammar", "compiler_for", "fill_bitmasks"]
