"""RS25-6 (pre-existing, off the path): one copy with a far-future iteration kills link 0's verifier for the run.

`VerifierHop._judge_copy` waits for the sender's input sketch only for stages 1..S; a forward copy over link 0
(a relay that puts itself as the path's data node: stage 1, path (E,)) has stage 0, so it is not waited for, and
`_remember(c, to)` is called with the copy's iteration before anything about the copy is checked. `it = 10**6`
sets `self.iteration` to 10**6: every slot, input sketch and seen microbatch of the real iterations is pruned, and
from then on `_on_copy` / `_take_receipt` refuse every real copy and receipt (`c.it < self.iteration - 1`). Link 0's
verdicts never come again: every microbatch is unverified and deferred, training stops. (With `bind`/`align` off,
no input sketch is waited for on any link: any relay kills any verifier.) One message from any relay; E takes one
strike (`unsigned`).
Usage: PYTHONPATH=$PWD python offpath_future_iteration.py [STEPS=7]
"""
import sys

from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.pipeline.config import LinkAttackConfig, PipelineRunConfig
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.runtime.pipeline import messages as m
from phalanx.runtime.pipeline.config import PipelineConfig
from phalanx.runtime.pipeline.links import Links
from phalanx.runtime.pipeline.verifier import VerifierConfig

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 7
START = 4
cfg = PipelineRunConfig(
    peers=7, data_nodes=1, steps=STEPS,
    train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.001, batch_size=4),
    pipeline=PipelineConfig(stages=2, microbatches=8, capacity=8, routing="swarm"),
    sentinel=VerifierConfig(enabled=True, placement="boundary", hop="off_path", warmup=24),
    attack=LinkAttackConfig(name="none", relays="", start=START, target="both"),
)
data_node, rogue = (peer_identity(cfg.seed, i).peer_id for i in (0, 1))
honest_copy, sent = Links.send_copy, []


async def send_copy(self, verifier, direction, to, c, pad):
    await honest_copy(self, verifier, direction, to, c, pad)
    if self.me == rogue and direction == "forward" and c.it >= START and not sent:
        sent.append(c.it)
        fake = m.Carry((data_node, 10**6, 0), 10**6, 1, (self.me,), c.tensor)
        await honest_copy(self, self.verifiers[0], "forward", to, fake, pad)


Links.send_copy = send_copy
summary = simulate_pipeline(cfg, progress=False)
done = [r["completed"] for r in summary["metrics"]]
flags = sorted({v["reason"] for v in summary["verdicts"] if v["peer"] == rogue and v["flagged"]})
print(f"one future-iteration copy sent at iteration {sent}: completed per iteration {done}, banned "
      f"{['E' if p == rogue else p[:6] for p in summary['banned']]}, E's flags {flags}")
if done[-1] == 0:
    print("FAIL: no microbatch aggregated after one copy from one relay")
