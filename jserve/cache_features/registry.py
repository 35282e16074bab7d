"""Every cache feature the engine knows, one line each: adding a feature is its folder and
a line here. Each entry builds the feature's two sides for one engine: the engine's, from
the state's parts, and the runner's, from the step's context (or None where the engine
will not use it; no type: the feature has no runner side of its own); each reads the
engine options it needs and ignores the others. Order matters where features book in the
same stage: the swap tier's swap-ins take their blocks before the other features' takes."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from jserve.cache_features.hidden_cache.feature import HiddenCache
from jserve.cache_features.hidden_cache.steps import HiddenSteps
from jserve.cache_features.layer_offload.feature import LayerOffload
from jserve.cache_features.layer_offload.steps import LayerSteps
from jserve.cache_features.protocol import (
    CacheFeature, SectionCheck, StateParts, StepContext, StepFeature,
)
from jserve.cache_features.swap_tier.feature import SwapTier
from jserve.engine.batch import Batch
from jserve.engine.plan import Plan
from jserve.errors import PlanError

FEATURES: tuple[tuple[Callable[..., CacheFeature], type[StepFeature] | None], ...] = (
    (SwapTier.build, None),
    (HiddenCache.build, HiddenSteps),
    (LayerOffload.build, LayerSteps),
)


def _check_options(builds: list[Callable[..., object]], options: dict[str, object]) -> None:
    known = {name for build in builds for name, p in inspect.signature(build).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY}
    if set(options) - known:
        raise TypeError(f"no cache feature takes the options {sorted(set(options) - known)}")


def build_features(parts: StateParts, **options: object) -> tuple[CacheFeature, ...]:
    _check_options([build for build, _ in FEATURES], options)
    return tuple(build(parts, **options) for build, _ in FEATURES)


def build_step_features(ctx: StepContext, **options: object) -> tuple[StepFeature, ...]:
    """The runner sides of the features the engine will use."""
    runner_sides = [steps for _, steps in FEATURES if steps is not None]
    _check_options([steps.build for steps in runner_sides], options)
    built = (steps.build(ctx, **options) for steps in runner_sides)
    return tuple(f for f in built if f is not None)


def refuse_unknown_steps(batch: Batch, features: tuple[StepFeature, ...]) -> None:
    """A runner refuses a batch with work of a feature it was not built with."""
    missing = set(batch.features) - {f.name for f in features}
    if missing:
        name = min(missing)
        raise RuntimeError(f"the batch has {name} sequences, and this runner was not "
                           f"built for them (no {name} steps)")


def check_sections_known(plan: Plan, features: tuple[CacheFeature, ...]) -> None:
    unknown = set(plan.features) - {f.name for f in features}
    if unknown:
        raise PlanError(f"plan has sections of unknown cache features {sorted(unknown)}")


def refuse_shared(plan: Plan, features: tuple[CacheFeature, ...], sections: tuple[SectionCheck, ...]) -> None:
    """A request is in one feature's own state at a time: refuse a plan that puts one in a
    feature's state while another holds it after the plan."""
    for feature, checked in zip(features, sections):
        if not checked.claims:
            continue
        claims = list(checked.claims)
        for other in features:
            held = other.holds_after(claims, plan) if other is not feature else None
            if held is not None and held.any():
                raise PlanError(f"seq {claims[int(np.argmax(held))]}: the {feature.name} and "
                                f"{other.name} cache features cannot both hold it")


NO_PLAN = Plan()


def held(features: tuple[CacheFeature, ...], seq_ids: list[int]) -> np.ndarray:
    """Which of `seq_ids` some feature holds in its own state now (their blocks are not
    plain whole KV blocks on the device)."""
    found = np.zeros(len(seq_ids), bool)
    for feature in features:
        found |= feature.holds_after(seq_ids, NO_PLAN)
    return found


def block_tokens(features: tuple[CacheFeature, ...], block_size: int, rows: np.ndarray,
                 plan: Plan | None = None) -> np.ndarray | int:
    """Tokens one block of each of `rows` holds (after `plan` when given): `block_size`
    unless a feature says otherwise."""
    tokens: np.ndarray | int = block_size
    for feature in features:
        found = feature.block_tokens(rows, plan)
        if found is not None:
            tokens = found
    return tokens
