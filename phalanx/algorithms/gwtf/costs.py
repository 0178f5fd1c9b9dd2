"""Costs: an edge's cost (Eq. 1) and the objective a move changes (Eq. 2's sum, or the local min-max)."""

from __future__ import annotations

import math

from ...core.errors import ConfigError


def edge_cost(
    compute_i: float,
    compute_j: float,
    latency_ij: float,
    latency_ji: float,
    bandwidth_ij: float,
    bandwidth_ji: float,
    size: float,
) -> float:
    """Eq. 1: d_ij = (c_i + c_j)/2 + (lat_ij + lat_ji)/2 + 2 size / (bw_ij + bw_ji)."""
    values = (compute_i, compute_j, latency_ij, latency_ji, bandwidth_ij, bandwidth_ji, size)
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ConfigError(f"edge_cost needs finite non-negative inputs, got {values}")
    if bandwidth_ij + bandwidth_ji <= 0:
        raise ConfigError("edge_cost needs a positive bandwidth in at least one direction")
    return (compute_i + compute_j) / 2 + (latency_ij + latency_ji) / 2 + 2 * size / (bandwidth_ij + bandwidth_ji)


def objective_delta(objective: str, old: tuple[float, ...], new: tuple[float, ...]) -> float:
    """How much a move from the edge costs `old` to `new` raises the objective ("sum" or "max")."""
    if objective == "max":
        return max(new) - max(old)
    return sum(new) - sum(old)
