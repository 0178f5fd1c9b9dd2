"""RW s26 f9: a stage of 2 replicas (no liar anywhere): a 1-1 split has no majority under either rule (496b700:
2 of 2 needed; 6d4b4bf: a strict majority of 2 answers), so it is never healed. Stages of 2 are what churn leaves
at the presets under BTARD (faults.stage_floor defaults to 2) and what a ban leaves of a stage of 3.
1 data node + 2 stages x 2 relays (peers=5); relay 3 (stage 2) splits at iteration 1 as in the commit's test.
Expected on 496b700 and 6d4b4bf: FAIL (two digests in stage 2 at the end; with RW_TASK=chars-gpt, watch for bans).
Run: [RW_TASK=chars-gpt] cd <worktree> && PYTHONPATH=$PWD nice -n 15 python /work/wt/reviews/s26-RW-scripts/f9_stage_of_two_never_heals.py [steps]
"""
import sys

from common import ChurnConfig, _config, gpt, relay, replace, report, split_at, stage_digests

from phalanx.runs.pipeline.run import simulate_pipeline

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
config = gpt(replace(_config(ChurnConfig(), steps=steps), peers=5))
config = replace(config, btard=replace(config.btard, validators=1))
split_at(config, relay(config, 3))
summary = simulate_pipeline(config, progress=False)
report(summary)
digests = stage_digests(summary, 2)
ok = len(set(digests.values())) == 1 and not summary["banned"]
print("PASS" if ok else "FAIL: the stage of two stays split (or an honest replica is banned)")
