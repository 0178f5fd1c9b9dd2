"""Random streams derived from (run seed, peer, step, purpose).

Every random choice in phalanx draws from one of these, so a run is a pure
function of its seed and any peer can re-derive another peer's public draws.
"""

from __future__ import annotations

import hashlib
import random

import torch


def derive_seed(run_seed: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and any path of names and numbers."""
    text = "/".join([str(run_seed), *(str(p) for p in parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def torch_stream(run_seed: int, *parts: object) -> torch.Generator:
    """A torch.Generator seeded from (run seed, *parts)."""
    gen = torch.Generator()
    gen.manual_seed(derive_seed(run_seed, *parts))
    return gen


def py_stream(run_seed: int, *parts: object) -> random.Random:
    """A random.Random seeded from (run seed, *parts)."""
    return random.Random(derive_seed(run_seed, *parts))
