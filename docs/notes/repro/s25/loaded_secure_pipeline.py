"""The real-process test's run (`tests/test_hivemind_secure_pipeline.py`: 1 data node, 2 stages x 3 relays, a zeros
link attacker, an agg_shift liar, a relay killed at iteration 2) in the simulator, on a loaded machine: every message
waits an extra exponential delay (mean MEAN s) before its destination process reads it, in the order it arrived
(one inbox per process: a descheduled process reads everything late, nothing overtakes) and every compute charge takes a random factor
(1 to 1 + 4 x MEAN / 0.1). Prints, per iteration, completed + flagged (the test wants 4) and every microbatch that
is neither ok nor flagged, with its outcome.
Run: PYTHONPATH=$PWD python docs/notes/repro/s25/loaded_secure_pipeline.py [MEAN=0.3] [SEED=0] [STEPS=12] [KEY=VALUE ...]
(KEY=VALUE: more config overrides, e.g. sentinel.verdict_timeout=5)
"""
import random
import sys

from phalanx.runs.config import override
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runs.presets import get_preset
from phalanx.transport import sim

MEAN = float(sys.argv[1]) if len(sys.argv) > 1 else 0.3
SEED = int(sys.argv[2]) if len(sys.argv) > 2 else 0
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 12
rng = random.Random(SEED)
last_arrival: dict = {}
transmit, charge = sim.SimNetwork._transmit, sim.SimTransport.charge_compute


def loaded_transmit(self, src, dst_id, topic, payload, arrive, *extra):
    def late(*args, **kwargs):  # the destination process was descheduled: it reads the message later, in order
        loop = self._running_loop()
        key = dst_id
        at = max(loop.time() + rng.expovariate(1 / MEAN), last_arrival.get(key, 0.0))
        last_arrival[key] = at
        loop.call_at(at, lambda: arrive(*args, **kwargs))
    transmit(self, src, dst_id, topic, payload, late, *extra)


async def loaded_charge(self, flops):
    await charge(self, flops * rng.uniform(1, 1 + 4 * MEAN / 0.1))


sim.SimNetwork._transmit, sim.SimTransport.charge_compute = loaded_transmit, loaded_charge
config = override(get_preset("secure-gpt-pipeline"), [
    "peers=7", f"steps={STEPS}", "pipeline.stages=2", "pipeline.microbatches=4", "pipeline.capacity=2",
    "sentinel.warmup=20", "btard.timeout=3", "allreduce.timeout=3",
    "attack.name=zeros", "attack.relays=0", "attack.start=7",
    "byzantine.attack=agg_shift", "byzantine.relays=1", "byzantine.start_step=3",
    "faults.crash_relay=4", "faults.crash_iteration=2", "faults.crash_at=0.0", *sys.argv[4:],
])
s = simulate_pipeline(config, progress=False)
ids = s["peer_ids"] if "peer_ids" in s else []
bad = 0
for r in s["metrics"]:
    mbs = [mb for mb in s["microbatches"] if mb["it"] == r["step"] if "step" in r] or \
          [mb for mb in s["microbatches"] if mb["it"] == r["it"]]
    it = r.get("step", r.get("it"))
    flagged = sum(mb["outcome"] == "flagged" for mb in mbs)
    odd = [(mb["seq"], mb["att"], mb["outcome"], mb["restarts"], mb["repairs"]) for mb in mbs if mb["outcome"] not in ("ok", "flagged")]
    bad += r["completed"] + flagged != 4
    print(f"it {it}: completed {r['completed']} flagged {flagged} duration {r['duration']:.2f}" + (f"  ODD {odd}" if odd else ""))
kinds = {}
for e in s["events"]:
    if e["kind"] in ("unverified", "verifier_silent"):
        kinds.setdefault(e["kind"], []).append((e["it"], e.get("mb"), e.get("links"), e.get("flagged")))
print("unverified/silent events:", kinds)
print("banned:", s["banned"])
print(f"MEAN {MEAN} SEED {SEED}: {bad} iterations with completed + flagged != 4")
