"""RB s25 finding 11 (e5724c6's anchor, kept in 2e775d7): a late starter's deadline is now the group's anchor + T, so
it may be (nearly) past when it starts, and a commitment its board lacks (lost on the link) is not pulled in time:
its `late_commit` drop of an honest committer that was in time for everyone else is an ELIMINATE of two honest peers.
With the old anchor (my start + T + lag) the late starter waited T from its start and pulled the lost one at T/4.

btard-digits, 6 peers, all honest, T = 1 s. At step STEP peer L begins 1.01 T late (0.98-1.03 alike) (a loaded machine); peer C's
commitment to L is lost (one dropped message; C's part to L arrives).

Run: cd <checkout> && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python /work/wt/reviews/s25-RB-scripts/f11_dp_late_starter_lost_commitment.py [delay in T]
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
from phalanx.runtime.rounds.btard import SecureRound
from phalanx.transport.base import BROADCAST_TOPIC
from phalanx.transport.sim import SimTransport

STEP, T = 1, 1.0


def main() -> int:
    delay = float(sys.argv[1]) if len(sys.argv) > 1 else 1.01
    peers = [peer_identity(0, i).peer_id for i in range(6)]
    L, C = peers[1], peers[2]
    names = {p: n for p, n in zip(peers, ["A", "L", "C", "D", "E", "F"])}
    with pytest.MonkeyPatch.context() as mp:
        send, join = SimTransport.send, SecureRound._join

        async def send_(self, peer, topic, payload):
            if self.peer_id == C and peer == L and topic == BROADCAST_TOPIC:
                env = SignedEnvelope.from_bytes(payload, C)
                if env.topic == "bt.commit" and env.step == STEP and env.sender == C:
                    return None  # lost
            return await send(self, peer, topic, payload)

        async def late(self, step, candidates):
            if step == STEP and self.transport.peer_id == L:
                await asyncio.sleep(delay * T)
            return await join(self, step, candidates)

        mp.setattr(SimTransport, "send", send_)
        mp.setattr(SecureRound, "_join", late)
        config = override(get_preset("btard-digits"), ["peers=6", "steps=3", "byzantine.count=0", "byzantine.attack=none",
                                                       "btard.validators=2", f"btard.timeout={T}"])
        with tempfile.TemporaryDirectory() as out:
            summary = simulate(config, Path(out), progress=False)
            records = [json.loads(line) for line in (Path(out) / "bans.jsonl").read_text().splitlines()]
    print("ban records:", [(names.get(r["peer"], "?"), r["reason"], names.get(r["accuser"], r["accuser"][:6]), r["step"]) for r in records])
    if records:
        print(f"FAIL: every peer is honest; banned: {sorted({names[r['peer']] for r in records})}")
        return 1
    print("ok: nobody banned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
