"""Every cache feature the engine knows, one line each: adding a feature is its folder and
a line here. Each entry builds the feature for one engine from the state's parts and the
engine's options (a feature reads the options it needs and ignores the others)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from jserve.cache_features.hidden_cache.feature import HiddenCache
from jserve.cache_features.layer_offload.feature import LayerOffload
from jserve.cache_features.protocol import CacheFeature, SectionCheck, StateParts
from jserve.engine.plan import Plan
from jserve.errors import PlanError

FEATURES: tuple[Callable[..., CacheFeature], ...] = (
    HiddenCache.build,
    LayerOffload.build,
)


def build_features(parts: StateParts, **options: object) -> tuple[CacheFeature, ...]:
    known = {name for build in FEATURES for name, p in inspect.signature(build).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY}
    if set(options) - known:
        raise TypeError(f"no cache feature takes the options {sorted(set(options) - known)}")
    return tuple(build(parts, **options) for build in FEATURES)


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
