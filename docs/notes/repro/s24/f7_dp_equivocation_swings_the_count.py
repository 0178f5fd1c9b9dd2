"""RB finding 7 (d10ded2's `passed_over` = silent for most): a colluder's two declarations swing the count for an
owner the honest owners are split on; the equivocation fetch is one-shot, so the honest peers pass over different sets.

`phalanx simulate` btard-digits, 6 peers, T = 1 s: peers 0 (A), 1 (B), 2 (C), 3 (D) honest; 4 (R), 5 (Q) colluders at
step STEP.  R commits to all but sends its part to C, D and Q only (and answers no pull of A's or B's): A and B drop R
as `missing_part` (silent; each an ELIMINATE of R: the accepted trade), C and D use it: 2 silent drops of 5 others.
Q withholds its declaration (and serves it to no pull) until A and B have declared, then, right after one of C's
pulls: v1 (R dropped `missing_part`: 3 drops > 5/2, R passed over) to A, B and D; once their `_passed_over` fetch
(the equivocation check, asked once) has returned, v2 (R used: 2 drops, R applied) to C.  C decides with v2 at once
(every declaration in), passes nobody over, so fetches nothing.  A, B, D pass R over; C applies R's partition.
Under main's rule (passed over only if EVERY other declaration drops it) C's and D's declarations keep R applied
everywhere, whatever Q signs; main has the mirror hole (every honest owner drops R, Q's v2 revives it at one peer).

Run: cd <checkout> && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python /work/wt/reviews/s24-RB-scripts/f7_dp_equivocation_swings_the_count.py
"""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import pytest

from phalanx.core.envelope import SignedEnvelope
from phalanx.core.errors import PeerTimeout
from phalanx.core.serialization import decode, encode
from phalanx.runs.config import override
from phalanx.runs.dp.simulate import simulate
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.presets import get_preset
from phalanx.runtime.rounds.btard import SecureRound
from phalanx.transport.base import BROADCAST_TOPIC, Transport
from phalanx.transport.sim import SimTransport

STEP, T = 1, 1.0


def main() -> int:
    A, B, C, D, R, Q = (peer_identity(0, i).peer_id for i in range(6))
    names = {A: "A", B: "B", C: "C", D: "D", R: "R", Q: "Q"}
    colluders = {R, Q}
    state = {"declared": set(), "c_pulls": 0, "fetched": set()}
    log: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        broadcast, serve_board, send, request, fetch, passed = (Transport.broadcast, Transport._serve_board, SimTransport.send,
                                                                SimTransport.request, Transport.fetch_broadcasts, SecureRound._passed_over)

        async def send_(self, peer, topic, payload):
            if self.peer_id == R and topic == "ar.part" and peer in (A, B) and decode(payload, R).get("step") == STEP:
                return None
            return await send(self, peer, topic, payload)

        async def request_(self, peer, topic, payload, timeout):
            if peer == R and topic == "ar.pull" and self.peer_id in (A, B) and decode(payload, self.peer_id).get("step") == STEP:
                raise PeerTimeout(peer, "R answers A and B nothing")
            return await request(self, peer, topic, payload, timeout)

        async def fetch_(self, topic, step, senders, sources, timeout):
            await fetch(self, topic, step, senders, sources, timeout)
            if self.peer_id == C and topic == "bt.rcommit" and step == STEP:
                state["c_pulls"] += 1

        async def passed_(self, st, drops):
            out = await passed(self, st, drops)
            if st.step == STEP:
                state["fetched"].add(self.transport.peer_id)
                log.append(f"t={self.transport.clock.now():.3f} {names[self.transport.peer_id]} passes over {sorted(names[p] for p in out)}")
            return out

        async def broadcast_(self, topic, step, payload):
            if topic == "bt.rcommit" and step == STEP and self.peer_id in (A, B):
                state["declared"].add(self.peer_id)
            if not (self.peer_id == Q and topic == "bt.rcommit" and step == STEP):
                return await broadcast(self, topic, step, payload)
            obj = decode(payload, Q)
            v2 = SignedEnvelope.create(self.identity, topic, step, encode({**obj, "from": sorted(set(obj["from"]) | {R}),
                                                                           "drop": {p: r for p, r in obj["drop"].items() if p != R}}))
            v1 = SignedEnvelope.create(self.identity, topic, step, encode({**obj, "from": [p for p in obj["from"] if p != R],
                                                                           "drop": {**obj["drop"], R: "missing_part"}}))
            while state["declared"] != {A, B}:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.02)
            pulls = state["c_pulls"]
            while state["c_pulls"] == pulls:  # right after one of C's pulls
                await asyncio.sleep(0.001)
            log.append(f"t={self.clock.now():.3f} Q sends v1 (R dropped) to A, B, D")
            for peer in (A, B, D):
                await self.send(peer, BROADCAST_TOPIC, v1.to_bytes())
            while not {A, B, D} <= state["fetched"]:
                await asyncio.sleep(0.001)
            log.append(f"t={self.clock.now():.3f} Q sends v2 (R used) to C (C's pulls so far: {state['c_pulls']})")
            await self.send(C, BROADCAST_TOPIC, v2.to_bytes())
            return v1

        async def serve_board_(self, sender, payload):
            answer = await serve_board(self, sender, payload)
            if self.peer_id not in colluders or sender in colluders:
                return answer
            return encode([e for e in decode(answer, sender) if not (
                (env := SignedEnvelope.from_bytes(e, sender)).sender == Q and env.step == STEP and env.topic == "bt.rcommit")])

        mp.setattr(SimTransport, "send", send_)
        mp.setattr(SimTransport, "request", request_)
        mp.setattr(Transport, "fetch_broadcasts", fetch_)
        mp.setattr(SecureRound, "_passed_over", passed_)
        mp.setattr(SimTransport, "broadcast", broadcast_, raising=False)
        mp.setattr(Transport, "_serve_board", serve_board_)
        config = override(get_preset("btard-digits"), ["peers=6", "steps=3", "byzantine.count=0", "byzantine.attack=none",
                                                       "btard.validators=0", f"btard.timeout={T}"])
        with tempfile.TemporaryDirectory() as out:
            summary = simulate(config, Path(out), progress=False)
            records = [json.loads(line) for line in (Path(out) / "bans.jsonl").read_text().splitlines()]
    for line in log:
        print(line)
    honest = [A, B, C, D]
    print("final digests of the honest peers:", {names[p]: summary["final_digests"][p][:12] for p in honest})
    print("banned by each honest peer:", {names[p]: sorted(names.get(x, x[:6]) for x in summary["banned_by_peer"][p]) for p in honest})
    print("ban records:", [(names.get(r["peer"], "?"), r["reason"], names.get(r["accuser"], r["accuser"][:6])) for r in records])
    # an honest peer banned as a colluder's ELIMINATE partner (eliminated by a colluder, or eliminator of one) is the trade
    traded = {r["peer"] for r in records if r["accuser"] in colluders and r["reason"].startswith("eliminated:")}
    traded |= {r["peer"] for r in records if r["reason"] == "eliminator" and any(
        o["accuser"] == r["accuser"] and o["step"] == r["step"] and o["peer"] in colluders for o in records)}
    wrong = {names[p]: sorted(names[x] for x in summary["banned_by_peer"][p] if x in honest and x not in traded) for p in honest}
    training = [p for p in honest if p not in summary["banned_by_peer"][p]]
    digests = {summary["final_digests"][p] for p in training}
    ledgers = {tuple(sorted(summary["banned_by_peer"][p])) for p in training}
    if len(digests) > 1 or any(wrong.values()) or len(ledgers) > 1:
        print(f"FAIL: the honest peers still training ({[names[p] for p in training]}) hold {len(digests)} different models and "
              f"{len(ledgers)} different ledgers; honest banned by honest (not as a colluder's ELIMINATE partner): {wrong}")
        return 1
    print("ok: the honest peers agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
