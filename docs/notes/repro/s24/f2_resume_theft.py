"""RP finding 2: any relay of stage s takes, by RESUME, the backward gradient a stage-(s+1) relay delivered to a peer
that left (`delivered`, new in 4de3cb0), under a path it writes itself. The helper's scenario with 3 relays per
stage: a second stage-2 relay (the thief) runs the protocol honestly and, every 50 ms, asks each stage-3 relay to
RESUME every key it can guess; it answers OK to the backward that comes and drops it. The holder's delivered
gradient goes to the thief, the data node's PING `delivered_to` then finds nothing, and the victim falls back to
the restart after a COMPLETE timeout (the behaviour 4de3cb0 set out to remove).
Run: cd /work/wt/rP && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python <this file> [--honest]
"""
import asyncio
import sys
from dataclasses import replace

sys.path.insert(0, "tests")
from test_pipeline import _left_after_its_backward  # noqa: E402

from phalanx.core.serialization import encode  # noqa: E402
from phalanx.runs.dp.swarm import peer_identity  # noqa: E402
from phalanx.runs.pipeline.run import simulate_pipeline  # noqa: E402
from phalanx.runtime.pipeline import messages as m  # noqa: E402
from phalanx.runtime.pipeline.relay import Relay  # noqa: E402

ATTACK = "--honest" not in sys.argv
config = replace(_left_after_its_backward("gwtf"), peers=10)  # 1 data node + 3 stages x 3 relays
stage2 = [peer_identity(config.seed, i).peer_id for i in range(config.peers) if config.stage_of(i) == 2]
THIEF = stage2[int(sys.argv[sys.argv.index("--thief") + 1])] if "--thief" in sys.argv else stage2[-1]
stolen: list = []
serve, on_backward = Relay.serve, Relay._on_backward


async def thief_serve(self) -> None:
    if ATTACK and self.me == THIEF:
        self.spawn(steal(self))
    await serve(self)


async def steal(self) -> None:
    while True:
        await asyncio.sleep(0.05)
        src = next(p for p, s in self.directory.items() if s == 0)
        first = next(p for p, s in self.directory.items() if s == 1)
        for seq in range(config.pipeline.microbatches * (self.version + 1)):
            if (src, seq, 0) in self.held:
                continue  # one it serves: a real repair of it is not theft
            body = encode({"src": src, "seq": seq, "att": 0, "path": [src, first, self.me], "rec": []})
            for holder in self.live(3):
                if await self._ask(holder, m.RESUME, body, timeout=0.5) == m.OK:
                    stolen.append((seq, holder[:8], round(self.now(), 2)))


async def thief_backward(self, sender: str, payload: bytes) -> bytes:
    c = m.parse_carry(payload, sender, self.transport.limits, self.last + 1)
    if ATTACK and self.me == THIEF and c.key not in self.held:
        return m.answer(m.OK)  # a stolen gradient: taken, dropped
    return await on_backward(self, sender, payload)


Relay.serve, Relay._on_backward = thief_serve, thief_backward
s = simulate_pipeline(config, progress=False)
first = next(e for e in s["events"] if e["kind"] == "bwd" and e["stage"] == 2 and e["it"] == 1)
v = next(mb for mb in s["microbatches"] if (mb["src"], mb["seq"], mb["it"]) == (first["src"], first["seq"], 1))
print("crashed stage-2 relay:", first["peer"][:8], "thief:", THIEF[:8] if ATTACK else None)
print("gradients stolen (seq, holder, t):", stolen)
print(f"victim seq {v['seq']}: outcome={v['outcome']} att={v['att']} restarts={v['restarts']} repairs={v['repairs']}")
print("iteration durations:", [round(r["duration"], 2) for r in s["metrics"]])
if ATTACK and v["restarts"]:
    print("FAIL: the thief took the delivered gradient; the victim restarted instead of being repaired")
for mb in s["microbatches"]:
    if mb["it"] == 1:
        print(f"  it1 seq {mb['seq']}: att={mb['att']} restarts={mb['restarts']} repairs={mb['repairs']} "
              f"t_start={mb['t_start']:.2f} t_end={mb['t_end']:.2f} path={[p[:8] for p in mb['path']]}")
