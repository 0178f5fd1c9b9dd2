"""Verifier variants and table cells shared by SENTINEL's two bench engines (`sentinel`, in-process,
and `sentinel_sim`, the pipeline runtime in the simulator)."""

from __future__ import annotations

import dataclasses

from ..algorithms.sentinel.statistics import DISTANCES, SentinelConfig
from ..core.errors import ConfigError

VOTE_TOKENS = {"any": "any", "majority": "majority", "unanimous": "all"}


def apply_variant(verifier: SentinelConfig, variant: str) -> SentinelConfig:
    """The verifier config of an ablation variant: "all" (as configured) or "/"-joined tokens, each one of
    `detect` (detect-only: flag and respond, never ban), `beta0` (beta_h = beta_g = 0), a vote (`any`,
    `majority`, `unanimous`) or a "+"-joined set of distances (e.g. `sign+swd`)."""
    for token in variant.split("/"):
        if token == "all":
            continue
        if token == "detect":
            verifier = dataclasses.replace(verifier, detect_only=True)
        elif token == "beta0":
            verifier = dataclasses.replace(verifier, beta_h=0.0, beta_g=0.0)
        elif token in VOTE_TOKENS:
            verifier = dataclasses.replace(verifier, vote=VOTE_TOKENS[token])
        elif token in DISTANCES or "+" in token:
            verifier = dataclasses.replace(verifier, distances=token.replace("+", ","))
        else:
            raise ConfigError(f"unknown ablation variant token {token!r} in {variant!r}; allowed: detect, beta0, "
                              f"{', '.join(VOTE_TOKENS)}, or distances joined by '+' (e.g. sign+swd)")
    return verifier


def format_cell(value, spec: str = ".3f") -> str:
    """One table cell: "-" for a missing value, "nan" for NaN, floats with `spec`."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if value != value else format(value, spec)
    return str(value)
