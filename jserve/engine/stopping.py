"""When a generated token ends a request before its length does: EOS, a stop token id or
a stop string (vLLM's rules). Reading a token means Python per token, so only requests
that can end this way, or whose text is streamed, are read (`watches_tokens`); the
others (every request the simulator runs) end by length, checked over the columns."""

from __future__ import annotations

from jserve.engine.request import Request


def watches_tokens(req: Request, eos_token_id: int | None) -> bool:
    """Whether each of the request's tokens must be read: for its text, or because it
    can end the request."""
    params = req.params
    return (req.detokenizer is not None or bool(params.stop) or bool(params.stop_token_ids)
            or (eos_token_id is not None and not params.ignore_eos) or req.matcher is not None)


def stops_at(req: Request, token: int, eos_token_id: int | None) -> bool:
    """Add the new token's text; whether the token ends the request. A stop id or string
    is kept as its `stop_reason`, and a stop string is cut from the text (kept with
    `include_stop_str_in_output`), once the output is longer than `min_tokens` (EOS and
    stop ids cannot be sampled before: the runner masks them). A grammar's matcher
    advances by the token (its mask allows EOS alone once the grammar is complete, so the
    EOS rule ends the request)."""
    params = req.params
    if req.matcher is not None:
        req.matcher.accept(token)
    before = len(req.text)
    if req.detokenizer is not None:
        req.text += req.detokenizer.push(token)
    if token == eos_token_id and not params.ignore_eos:
        return True
    if token in params.stop_token_ids:
        req.stop_reason = token
        return True
    return bool(params.stop) and len(req.output_token_ids) > params.min_tokens and _hit_stop_string(req, before)


def _hit_stop_string(req: Request, before: int) -> bool:
    """A stop string ending in the text added after `before` (vLLM's search: text written
    before `min_tokens` tokens never stops the request, as none before it had)."""
    for stop in req.params.stop:
        at = req.text.find(stop, max(0, before - len(stop) + 1))
        if at >= 0:
            end = at + len(stop) if req.params.include_stop_str_in_output else at
            req.text = req.text[:end]
            req.stop_reason = stop
            return True
    return False
