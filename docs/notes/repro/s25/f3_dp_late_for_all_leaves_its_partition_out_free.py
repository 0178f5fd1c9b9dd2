"""RB s25 finding 3: 8e927b7 prices `deadline_edge`'s in-time half, but a Byzantine that commits late for ALL owners
(nobody uses it in time: no `late_for_most` use to price) still leaves its own partition out at no cost, every step.

btard-digits, 6 peers, T = 1 s, validators 2; the Byzantine peer (R) runs the protocol attack `deadline_edge` from step 1
with its commitment sent to everyone 1.2 x T after its start (instead of half at 0.95 T, half at 1.05 T): every
owner drops it `late_commit` (late for most: no claim), it is silent for most (passed over: its partition left out,
zero on every honest peer), and nobody uses it (no ELIMINATE). Its own declaration leaves its own part out (it
drops itself `late_commit`, so the declared set matches `contributors`: no `declaration` accusation). It stays in
the group. The red team harness counts
that as "colluder X's partition was left out and it stayed in the group for k more steps unbanned" (it has no move
that plays it: its `deadline_edge` is always half and half).

Run: cd <checkout> && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python /work/wt/reviews/s25-RB-scripts/f3_dp_late_for_all_leaves_its_partition_out_free.py
"""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import pytest

from phalanx.core.envelope import SignedEnvelope
from phalanx.runs.config import override
from phalanx.runs.dp.simulate import simulate
from phalanx.algorithms.btard.attacks import DeadlineEdge
from phalanx.runs.dp.swarm import byzantine_indices, peer_identity
from phalanx.runs.presets import get_preset
from phalanx.runtime.rounds import btard as btard_module
from phalanx.runtime.rounds.btard import SecureRound
from phalanx.transport.base import BROADCAST_TOPIC

STEPS = 6


def main() -> int:
    peers = [peer_identity(0, i).peer_id for i in range(6)]
    R = peers[byzantine_indices(override(get_preset("btard-digits"), ["peers=6", "byzantine.count=1"]))[0]]
    names = dict(zip([p for p in peers if p != R], "ABCDE")) | {R: "R"}
    passed_log: dict[int, set[str]] = {}
    with pytest.MonkeyPatch.context() as mp:
        passed = SecureRound._passed_over

        async def late_for_all(tr, topic, step, payload, deadline):
            await asyncio.sleep(1.2 * deadline)
            envelope = SignedEnvelope.create(tr.identity, topic, step, payload)
            tr.board.add(envelope)
            for peer in [p for p in tr.members() if p != tr.peer_id]:
                await tr.send(peer, BROADCAST_TOPIC, envelope.to_bytes())

        async def passed_(self, st, drops):
            out = await passed(self, st, drops)
            if self.transport.peer_id != R:
                passed_log.setdefault(st.step, set()).update(names[p] for p in out)
            return out

        def declare(self, step, used, dropped, owners):  # its own part is not in its aggregate: consistent with its lateness
            if not self.active(step):
                return used, dropped
            return [p for p in used if p not in self.colluders], {**dropped, **{p: "late_commit" for p in self.colluders}}

        mp.setattr(btard_module, "edge_broadcast", late_for_all)
        mp.setattr(DeadlineEdge, "declare", declare, raising=False)
        mp.setattr(SecureRound, "_passed_over", passed_)
        config = override(get_preset("btard-digits"), ["peers=6", f"steps={STEPS}", "byzantine.count=1", "byzantine.attack=deadline_edge",
                                                       "byzantine.start_step=1", "btard.validators=2", "btard.timeout=1.0"])
        with tempfile.TemporaryDirectory() as out:
            summary = simulate(config, Path(out), progress=False)
            records = [json.loads(line) for line in (Path(out) / "bans.jsonl").read_text().splitlines()]
    print("owners passed over (by some honest peer), per step:", {s: sorted(v) for s, v in sorted(passed_log.items())})
    print("ban records:", [(names.get(r["peer"], "?"), r["reason"], names.get(r["accuser"], r["accuser"][:6]), r["step"]) for r in records])
    left_out = [s for s, v in passed_log.items() if "R" in v]
    if len(left_out) >= 2 and not any(r["peer"] == R for r in records):
        print(f"FAIL: R's partition was left out at steps {sorted(left_out)} and R was never banned")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
