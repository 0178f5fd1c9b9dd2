"""RW s26 f10: what a judge that cannot judge leaves behind. Stage of 4 (peers=9): relay 1 forges its stage
gradient from iteration 2 (`approve_all`: sign flip x1000, and approves whatever it validates); honest relay 5
holds weights of another version for step 2 (modelled: its kept `_Iteration` of step 2 says version 1, as a
joiner behind at that round's start would), so it neither validates nor judges step 2 (`CannotJudge`): the other
honest replicas ban relay 1, relay 5 does not. Does relay 5 then fall out of step (group mismatch, weights split,
a ban), or does the stage converge?
Run: [RW_TASK=chars-gpt] cd <worktree> && PYTHONPATH=$PWD nice -n 15 python /work/wt/reviews/s26-RW-scripts/f10_cannot_judge_divergence.py [steps] [once]
"""
import dataclasses
import sys

from common import ChurnConfig, _config, gpt, relay, report, stage_digests

from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.pipeline import stage_btard

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
once = len(sys.argv) > 2 and sys.argv[2] == "once"  # the liar forges at iteration 2 only (the abstainer's step)
config = gpt(_config(ChurnConfig(), attack="approve_all", steps=steps))
if once:
    config = dataclasses.replace(config, byzantine=dataclasses.replace(config.byzantine, every=1000))
liar, abstainer = relay(config, 1), relay(config, 5)
record = stage_btard.StageInputs.record


def record_behind(self, it, group):
    record(self, it, group)
    if self.node.me == abstainer and it == 2:
        self.kept[it] = dataclasses.replace(self.kept[it], version=it - 1)


stage_btard.StageInputs.record = record_behind
summary = simulate_pipeline(config, progress=False)
report(summary)
by = {}
for b in summary["bans"]:
    by.setdefault(b.get("peer", "")[:8] if isinstance(b, dict) else str(b), []).append(b)
bans = [e for e in summary["events"] if e["kind"] == "ban"]
print("ban events (peer, step, reason, by):", [(e["peer"][:8], e["step"], e["reason"], e["by"][:8]) for e in bans])
digests = {p: d for p, d in stage_digests(summary, 2).items() if p != liar}
honest_banned = [p[:8] for p in summary["banned"] if p != liar]
print("abstainer at the last version:", abstainer in summary["replicas"], "; honest banned:", honest_banned)
ok = liar in summary["banned"] and not honest_banned and len(set(digests.values())) == 1 and abstainer in summary["replicas"]
print("PASS" if ok else "FAIL: the abstaining judge falls out of step or is banned")
