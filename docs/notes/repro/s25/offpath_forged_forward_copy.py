"""RS25-2 (pre-existing): off the path, a relay NOT on a microbatch's path taints it with one forged forward copy.

COLLUDE=1 (against the fix that taints only once a receipt pairs the copy): the forged copy is addressed to a
colluding stage-2 relay C, which sends the verifier the receipt for it (E's record is signed to C, so it may).

Relay E (stage 1) sends, beside its first real forward copy over link 1 of each iteration, forged forward copies of FORGE other
microbatches of the iteration (ones it does not serve): its own valid signed record, no link-0 record (it has none).
The link-1 verifier judges it once the input sketch of the real microbatch arrives, rejects it (`forged_hop`, a strike
against E alone) and taints the microbatch for every verifier: the real stage-2 relay's gradient is then "tainted"
(not cleared), so the microbatch is left out of the aggregation. RA s23 finding 2 (a relay off the path can neither
flag nor plant) was closed for backward copies and outputs; forward copies still taint.
Usage: PYTHONPATH=$PWD python offpath_forged_forward_copy.py [FORGE=1] [STEPS=8] [COLLUDE=0]
"""
import sys

from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.pipeline.config import LinkAttackConfig, PipelineRunConfig
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.runtime.pipeline import messages as m
from phalanx.runtime.pipeline.config import PipelineConfig
from phalanx.runtime.pipeline.links import Links
from phalanx.runtime.pipeline.verifier import RECEIPT, VerifierConfig
from phalanx.core.serialization import encode

FORGE = int(sys.argv[1]) if len(sys.argv) > 1 else 1
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
START = 4
COLLUDE = len(sys.argv) > 3 and sys.argv[3] == "1"


def config() -> PipelineRunConfig:
    return PipelineRunConfig(
        peers=7, data_nodes=1, steps=STEPS,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.001, batch_size=4),
        pipeline=PipelineConfig(stages=2, microbatches=8, capacity=8, routing="swarm"),
        sentinel=VerifierConfig(enabled=True, placement="boundary", hop="off_path", warmup=24),
        attack=LinkAttackConfig(name="none", relays="", start=START, target="both"),
    )


def run(forge: int) -> dict:
    cfg = config()
    data_node, forger, colluder = (peer_identity(cfg.seed, i).peer_id for i in (0, 1, 5))
    honest_copy = Links.send_copy
    served, forged, done = set(), set(), set()
    links = {}  # peer -> its Links object (the colluder's transport sends the receipt)

    async def send_copy(self, verifier, direction, to, c, pad):
        links[self.me] = self
        await honest_copy(self, verifier, direction, to, c, pad)
        if self.me != forger:
            return
        served.add(c.key)
        if direction != "forward" or c.it < START or forge == 0 or c.it in done:
            return
        done.add(c.it)  # FORGE forged copies per iteration, sent beside E's first real copy of it
        targets = [(data_node, seq, 0) for seq in range(8 * c.it, 8 * c.it + 8)
                   if (data_node, seq, 0) not in served and (c.it, (data_node, seq, 0)) not in forged][:forge]
        for key in targets:
            forged.add((c.it, key))
            receiver = colluder if COLLUDE else to
            own = m.Hop.signed(self.transport.identity, key, c.it, "forward", 1, "", b"", m.tensor_digest(c.tensor),
                               receiver)
            fake = m.Carry(key, c.it, 2, (data_node, self.me), c.tensor, hops=(own,))
            await honest_copy(self, verifier, "forward", receiver, fake, pad)
            if COLLUDE and colluder in links:  # C: "I received it"
                await links[colluder].transport.send(verifier, RECEIPT, encode({"hop": own.to_obj()}))

    Links.send_copy = send_copy
    try:
        summary = simulate_pipeline(cfg, progress=False)
    finally:
        Links.send_copy = honest_copy
    left_out = sorted((mb["it"], mb["seq"]) for mb in summary["microbatches"] if mb["outcome"] != "ok" and mb["it"] >= START)
    hit = sorted({(it, k[1]) for it, k in forged} & set(left_out))
    reasons = sorted({v["reason"] for v in summary["verdicts"] if v["peer"] == forger and v["flagged"]})
    print(f"forge={forge}: completed per iteration {[r['completed'] for r in summary['metrics']]}, "
          f"banned {['E' if p == forger else p[:6] for p in summary['banned']]}, E's flag reasons {reasons}, "
          f"forged {len(forged)}, microbatches left out from it {START}: {len(left_out)} (of them forged-for: {len(hit)})")
    return summary


if __name__ == "__main__":
    run(0)
    run(FORGE)
