"""RW s26 f5: an honest replica whose round ends more than complete_timeout / 2 after its peers' (a loaded machine;
no liar anywhere). Stage of 3 (peers=7): relay 3 splits at iteration 1 as in the commit's test, and relay 5
(honest, on the majority's weights) finishes each stage round `delay` simulated seconds after the others
(from iteration 1 on). Relay 3 asks relay 5 when its round ends, relay 5 has not stepped: it waits
complete_timeout / 2 (2.5 s) and answers None; the asker's request times out at the same 2.5 s. Relay 3 sees
{D2: [3], D1: [1]} and keeps D2; when relay 5 steps it finds D1 with relay 1 (2 of 3) and keeps it.
Expected on 496b700: FAIL for delay 3.0 (the split is never healed).
Run: cd <worktree> && PYTHONPATH=$PWD nice -n 15 python /work/wt/reviews/s26-RW-scripts/f5_late_honest_stepper.py [steps] [delay]
"""
import asyncio
import sys

from common import ChurnConfig, _config, relay, replace, report, split_at, stage_digests

from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.pipeline.stage_btard import StageRound

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
delay = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
config = replace(_config(ChurnConfig(), steps=steps), peers=7)
split, late = relay(config, 3), relay(config, 5)
split_at(config, split)
call = StageRound.__call__


async def slow(self, it, vector, group):
    result = await call(self, it, vector, group)
    if self.node.me == late and it >= 1:
        await asyncio.sleep(delay)
    return result


StageRound.__call__ = slow
summary = simulate_pipeline(config, progress=False)
report(summary)
digests = stage_digests(summary, 2)
ok = len(set(digests.values())) == 1
print("stage-2 replicas hold one model:", ok)
print("PASS" if ok else f"FAIL: an honest replica {delay} s late keeps its stage split (nobody lies)")
