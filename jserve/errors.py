"""Errors a caller can cause, kept apart from engine bugs so servers map them to 4xx."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses as given (bad sampling values, prompt too long, ...).

    `param` names the offending field as the OpenAI API spells it (`temperature`,
    `prompt`, ...), so the HTTP server's error JSON can point at it; None if no one field is
    to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(ValueError):
    """An engine option this machine or model cannot honour, found only while the engine is
    built (too few devices for the tensor-parallel size, heads that do not split): the
    user's to fix, so the CLI prints it as one `error:` line rather than a traceback."""


class PlanError(RuntimeError):
    """A policy returned a plan the engine state cannot honour: a policy bug, never trimmed."""
