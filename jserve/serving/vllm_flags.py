"""`vllm serve`'s habits on `jserve serve`: the model as a positional argument, and vLLM's
flags, each an alias of what jserve has or a refusal that says what jserve does instead.

A user moving from vLLM types `jserve serve MODEL --enable-prefix-caching --seed 0 ...`; an
unknown flag would stop them with a usage error, and a flag taken and ignored would promise
what jserve does not do, so every flag here does what it says or refuses with its reason.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from jserve.config import EngineConfig
from jserve.engine.sampling_params import MAX_LOGPROBS
from jserve.models.registry import DEFAULT_MODEL

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class NotSupported(ValueError):
    """A vLLM flag jserve has no equivalent for (the CLI prints it as one `error:` line)."""


def add_vllm_serve_args(parser: argparse.ArgumentParser) -> None:
    """The positional model and vLLM's flags, beside `--model` and jserve's own options."""
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    g = parser.add_argument_group("vLLM's flags", "accepted as `vllm serve` takes them")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="the prefix cache with LRU eviction, vLLM's (--prefix-cache lru; another "
                        "--prefix-cache rule wins); --no-enable-prefix-caching is jserve's default")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of random (dummy) weights; sampling is seeded per request already "
                        "(a request's `seed`, else one drawn from its sequence number)")
    g.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="only the model's own: jserve reads the tokenizer from the model (a "
                        "checkpoint's tokenizer.json, SmolLM2's package)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="not supported: the tokenizer's own chat template is used")
    g.add_argument("--enforce-eager", action="store_true",
                   help="not supported: every step is a compiled JAX program (--no-warmup "
                        "compiles them on first use instead)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted: jserve never logs a request's prompt or parameters (uvicorn's "
                        "access log is one line per request; --uvicorn-log-level warning drops it)")
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's log level, its access log included (default: %(default)s)")
    g.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help=f"only {MAX_LOGPROBS}, the alternatives jserve's compiled step returns "
                        "(vLLM's default too)")


@dataclass(frozen=True)
class VllmServeOptions:
    """What vLLM's flags leave for `jserve serve` to do beyond the engine options."""

    seed: int | None
    log_level: str

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        return config if self.seed is None else dataclasses.replace(config, seed=self.seed)


def apply_vllm_serve_args(args: argparse.Namespace) -> VllmServeOptions:
    """Fold vLLM's flags into jserve's options in `args` (the model, the prefix cache), or
    `NotSupported` naming the flag and what jserve does instead."""
    if args.model_arg is not None:
        if args.model not in (DEFAULT_MODEL, args.model_arg):
            raise NotSupported(f"two models given: {args.model_arg!r} and --model {args.model!r}")
        args.model = args.model_arg
    if args.enable_prefix_caching and args.prefix_cache == "none":
        args.prefix_cache = "lru"
    elif args.enable_prefix_caching is False and args.prefix_cache != "none":
        raise NotSupported(f"--no-enable-prefix-caching contradicts --prefix-cache {args.prefix_cache}")
    if args.tokenizer is not None and args.tokenizer != args.model:
        raise NotSupported(f"--tokenizer {args.tokenizer!r} is not supported: jserve reads the "
                           f"tokenizer from the model ({args.model!r}); write a checkpoint directory "
                           "with the tokenizer.json you want")
    if args.chat_template is not None:
        raise NotSupported("--chat-template is not supported: jserve renders chats with the "
                           "tokenizer's own template (a checkpoint's tokenizer_config.json)")
    if args.enforce_eager:
        raise NotSupported("--enforce-eager is not supported: every step is a compiled JAX program "
                           "(--no-warmup compiles them on first use instead of at start-up)")
    if args.max_logprobs is not None and args.max_logprobs != MAX_LOGPROBS:
        raise NotSupported(f"--max-logprobs {args.max_logprobs} is not supported: jserve's compiled "
                           f"step returns {MAX_LOGPROBS} alternatives, and requests may ask for up to "
                           f"{MAX_LOGPROBS}")
    return VllmServeOptions(args.seed, args.uvicorn_log_level)
