"""RB s25 finding 5 (finding 1 with colluders, data-parallel, no late-starting honest owner needed): two colluders
commit on time to every honest owner but B, and to B 0.9 T late. B's anchor then rests on their commitments, which it
only pulls from the others after a pull's patience (T/4: commitments are not passed on in the data-parallel round),
so B's deadline is ~T/4 later than A's, C's. An honest peer H whose commitment comes 1.1 T after the start (a slow
machine) is late for A, C, R, Q (4 of its 5 other owners: `late_for_most`) and in time for B, which uses it:
8e927b7's ELIMINATE(B, H) bans two honest peers; the colluders pay nothing (they were on time for everyone).

btard-digits, 6 peers, T = 1 s: A, B, C, H honest (peers 0-3), R, Q colluders (4, 5), at step STEP.

Mode `use` (second argument): the colluders commit late to B and C (both honest deadlines late, A's early), wait for
H's commitment and use it: H is then late for A only (1 of 5, not late for most), and A's drop is the pre-existing
ELIMINATE(A, H) of task 2's shape (two honest; main too).

Run: cd <checkout> && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python /work/wt/reviews/s25-RB-scripts/f5_dp_colluders_part_honest_deadlines_around_a_late_honest.py [H's delay in T] [drop|use]
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
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.presets import get_preset
from phalanx.transport.base import BROADCAST_TOPIC
from phalanx.transport.sim import SimTransport

STEP, T = 1, 1.0


def main() -> int:
    late_by = float(sys.argv[1]) if len(sys.argv) > 1 else 1.1
    mode = sys.argv[2] if len(sys.argv) > 2 else "drop"
    A, B, C, H, R, Q = (peer_identity(0, i).peer_id for i in range(6))
    names = {A: "A", B: "B", C: "C", H: "H", R: "R", Q: "Q"}
    colluders = {R, Q}
    delayed = (B,) if mode == "drop" else (B, C)
    with pytest.MonkeyPatch.context() as mp:
        from phalanx.runtime.rounds.btard import SecureRound
        commitments = SecureRound._commitments

        async def waits_for_h(self, st):
            got = await commitments(self, st)
            if mode == "use" and self.transport.peer_id in colluders and st.step == STEP:
                got = await self.transport.collect_broadcasts("bt.commit", st.step, st.committers, late_by * T + 0.3,
                                                              relays=len(st.members))
            return got

        mp.setattr(SecureRound, "_commitments", waits_for_h)
        broadcast = SimTransport.broadcast if hasattr(SimTransport, "broadcast") else None
        from phalanx.transport.base import Transport
        broadcast = Transport.broadcast

        async def broadcast_(self, topic, step, payload):
            if topic == "bt.commit" and step == STEP and self.peer_id == H:
                await asyncio.sleep(late_by * T)  # a slow machine: its commitment goes out late
                return await broadcast(self, topic, step, payload)
            if topic == "bt.commit" and step == STEP and self.peer_id in colluders:
                envelope = SignedEnvelope.create(self.identity, topic, step, payload)
                self.board.add(envelope)
                for peer in [p for p in self.members() if p != self.peer_id and p not in delayed]:
                    await self.send(peer, BROADCAST_TOPIC, envelope.to_bytes())

                async def to_b_late():
                    await asyncio.sleep(0.9 * T)
                    for peer in delayed:
                        await self.send(peer, BROADCAST_TOPIC, envelope.to_bytes())

                later.add(asyncio.ensure_future(to_b_late()))
                return envelope
            return await broadcast(self, topic, step, payload)

        later: set = set()
        mp.setattr(SimTransport, "broadcast", broadcast_, raising=False)
        config = override(get_preset("btard-digits"), ["peers=6", "steps=3", "byzantine.count=0", "byzantine.attack=none",
                                                       "btard.validators=2", f"btard.timeout={T}"])
        with tempfile.TemporaryDirectory() as out:
            summary = simulate(config, Path(out), progress=False)
            records = [json.loads(line) for line in (Path(out) / "bans.jsonl").read_text().splitlines()]
    honest = [A, B, C, H]
    print("ban records:", [(names.get(r["peer"], "?"), r["reason"], names.get(r["accuser"], r["accuser"][:6]), r["step"]) for r in records])
    banned_honest = sorted({names[r["peer"]] for r in records if r["peer"] in honest})
    if banned_honest:
        print(f"FAIL: honest peers banned, no colluder banned with them: {banned_honest}")
        return 1
    print("ok: no honest peer banned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
