"""RB s25 probe 4 (for task 2): Byzantine owners that leave honest parts out of their partitions and declare them
`late_commit` (the honest commitments were in time for every other owner). Each such drop must stay a claim (an
ELIMINATE: the owner goes with one victim), else a colluding owner aggregates its colluders' parts only, for free.

btard-digits, 6 peers, T = 1 s, validators 2, two colluders running `drop_honest` from step 1 with the reason
`late_commit` instead of `missing_part`. Passes when every colluder is banned by step 2 (ELIMINATE with one honest).

Run: cd <checkout> && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python /work/wt/reviews/s25-RB-scripts/f4_owners_drop_honest_parts_as_late.py [reason]
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from phalanx.algorithms.btard.attacks import DropHonest
from phalanx.runs.config import override
from phalanx.runs.dp.simulate import simulate
from phalanx.runs.dp.swarm import byzantine_indices, peer_identity
from phalanx.runs.presets import get_preset


def main() -> int:
    reason = sys.argv[1] if len(sys.argv) > 1 else "late_commit"
    config = override(get_preset("btard-digits"), ["peers=6", "steps=4", "byzantine.count=2", "byzantine.attack=drop_honest",
                                                   "byzantine.start_step=1", "btard.validators=2", "btard.timeout=1.0"])
    colluders = {peer_identity(0, i).peer_id for i in byzantine_indices(config)}
    names = {peer_identity(0, i).peer_id: ("Q" if i in byzantine_indices(config) else "H") + str(i) for i in range(6)}

    def declare(self, step, used, dropped, owners):
        if not self.active(step):
            return used, dropped
        return [p for p in used if p in self.colluders], {**dropped, **{p: reason for p in used if p not in self.colluders}}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DropHonest, "declare", declare)
        with tempfile.TemporaryDirectory() as out:
            summary = simulate(config, Path(out), progress=False)
            records = [json.loads(line) for line in (Path(out) / "bans.jsonl").read_text().splitlines()]
    print("ban records:", [(names.get(r["peer"], "?"), r["reason"], names.get(r["accuser"], r["accuser"][:6]), r["step"]) for r in records])
    unbanned = [names[c] for c in colluders if not any(r["peer"] == c and r["step"] <= 2 for r in records)]
    if unbanned:
        print(f"FAIL: colluders that dropped honest parts as {reason} are not banned by step 2: {unbanned}")
        return 1
    print("ok: each dropping colluder was banned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
