"""RB s25 finding 2: s24-RB 7 again on 34ee770 (declarations passed on, union of a declaration signed twice): the
equivocation check is still one fetch, and the version that decides at C reaches C only after C's fetch returned.

btard-digits, 6 peers, T = 1 s: A, B, C, D honest (peers 0-3), R, Q colluders (4, 5) at step STEP.
R commits to all but sends its part to C, D, Q only (answers no pull of A's or B's): A and B drop R `missing_part`,
2 silent drops of 5 others (one short of "more than half"). Q withholds its declaration until A, B, C, D declared,
then sends v2 (R used) to C only: C holds every declaration, R is decided "not passed" (2 drops), C holds a silent
drop so it runs `_passed_over`'s fetch, and passes v2 on to A, B, D. Q sends v1 (R dropped `missing_part`) to each of
A, B, D right after that one has answered C's fetch. Each of A, B, D then holds v2 and v1: the union passes R over
(3 drops), and each passes the proof on to C, but it reaches C one latency after that member's answer: C has
decided (its fetch ended with the last answer) on v2 alone and applies R's partition.

Run: cd <checkout> && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python /work/wt/reviews/s25-RB-scripts/f2_dp_equivocation_after_the_fetch_answers.py
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
from phalanx.runtime.rounds.btard import SecureRound
from phalanx.transport.base import BROADCAST_TOPIC, Transport
from phalanx.transport.sim import SimTransport

STEP, T = 1, 1.0


def main() -> int:
    A, B, C, D, R, Q = (peer_identity(0, i).peer_id for i in range(6))
    names = {A: "A", B: "B", C: "C", D: "D", R: "R", Q: "Q"}
    colluders = {R, Q}
    state: dict = {"declared": set(), "c_fetching": False, "v1_sent": set(), "q": None, "v1": None}
    log: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        broadcast, serve_board, send, request, passed = (Transport.broadcast, Transport._serve_board, SimTransport.send,
                                                         SimTransport.request, SecureRound._passed_over)

        async def send_(self, peer, topic, payload):
            if self.peer_id == R and topic == "ar.part" and peer in (A, B) and decode(payload, R).get("step") == STEP:
                return None
            return await send(self, peer, topic, payload)

        async def request_(self, peer, topic, payload, timeout):
            if peer == R and topic == "ar.pull" and self.peer_id in (A, B) and decode(payload, self.peer_id).get("step") == STEP:
                raise PeerTimeout(peer, "R answers A and B nothing")
            return await request(self, peer, topic, payload, timeout)

        async def passed_(self, st, drops):
            me = self.transport.peer_id
            if st.step == STEP and me == C:
                state["c_fetching"] = True
            out = await passed(self, st, drops)
            if st.step == STEP:
                log.append(f"t={self.transport.clock.now():.4f} {names[me]} passes over {sorted(names[p] for p in out)}")
            return out

        async def broadcast_(self, topic, step, payload):
            if topic == "bt.rcommit" and step == STEP and self.peer_id in (A, B, C, D):
                state["declared"].add(self.peer_id)
            if not (self.peer_id == Q and topic == "bt.rcommit" and step == STEP):
                return await broadcast(self, topic, step, payload)
            obj = decode(payload, Q)
            v2 = SignedEnvelope.create(self.identity, topic, step, encode({**obj, "from": sorted(set(obj["from"]) | {R}),
                                                                           "drop": {p: r for p, r in obj["drop"].items() if p != R}}))
            state["v1"] = SignedEnvelope.create(self.identity, topic, step, encode(
                {**obj, "from": [p for p in obj["from"] if p != R], "drop": {**obj["drop"], R: "missing_part"}}))
            state["q"] = self
            while state["declared"] != {A, B, C, D}:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.02)
            log.append(f"t={self.clock.now():.4f} Q sends v2 (R used) to C")
            await self.send(C, BROADCAST_TOPIC, v2.to_bytes())
            return v2

        async def serve_board_(self, sender, payload):
            answer = await serve_board(self, sender, payload)
            me = self.peer_id
            if me in colluders and sender not in colluders:  # Q's declaration served to no honest pull
                return encode([e for e in decode(answer, sender) if not (
                    (env := SignedEnvelope.from_bytes(e, sender)).sender == Q and env.step == STEP and env.topic == "bt.rcommit")])
            query = decode(payload, sender)
            if (me in (A, B, D) and sender == C and state["c_fetching"] and me not in state["v1_sent"]
                    and query.get("topic") == "bt.rcommit" and query.get("step") == STEP):
                state["v1_sent"].add(me)
                log.append(f"t={self.clock.now():.4f} {names[me]} answers C's fetch; Q sends it v1 (R dropped)")
                asyncio.ensure_future(state["q"].send(me, BROADCAST_TOPIC, state["v1"].to_bytes()))
            return answer

        mp.setattr(SimTransport, "send", send_)
        mp.setattr(SimTransport, "request", request_)
        mp.setattr(SecureRound, "_passed_over", passed_)
        mp.setattr(SimTransport, "broadcast", broadcast_, raising=False)
        mp.setattr(Transport, "_serve_board", serve_board_)
        config = override(get_preset_("btard-digits"), ["peers=6", "steps=3", "byzantine.count=0", "byzantine.attack=none",
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


def get_preset_(name):
    from phalanx.runs.presets import get_preset
    return get_preset(name)


if __name__ == "__main__":
    sys.exit(main())
