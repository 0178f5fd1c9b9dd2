"""RW s26 f8: does an existing BTARD protocol attack of a stage member (a liar in the round itself, no STEPPED
lie) leave the honest replicas on different weights, and what does agree_weights then make of it?
Stage of 3 (peers=7), relay 1 runs `attack` from iteration 2 (tests/test_stage_churn.py `_config`).
Run: [RW_TASK=chars-gpt] cd <worktree> && PYTHONPATH=$PWD nice -n 15 python \
    /work/wt/reviews/s26-RW-scripts/f8_protocol_attack_splits.py ATTACK [steps] [peers]
"""
import sys

from common import ChurnConfig, _config, gpt, relay, replace, report, stage_digests

from phalanx.runs.pipeline.run import simulate_pipeline

attack = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
peers = int(sys.argv[3]) if len(sys.argv) > 3 else 7
config = gpt(replace(_config(ChurnConfig(), attack=attack, steps=steps), peers=peers))
liar = relay(config, 1)
summary = simulate_pipeline(config, progress=False)
report(summary)
honest_banned = [p[:8] for p in summary["banned"] if p != liar]
print("liar", liar[:8], "banned:", liar in summary["banned"], "; honest banned:", honest_banned)
digests = {p: d for p, d in stage_digests(summary, 2).items() if p != liar}
ok = len(set(digests.values())) <= 1 and not honest_banned
print("PASS" if ok else "FAIL: honest replicas split or banned")
