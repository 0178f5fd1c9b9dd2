"""RW s26 f1: one member of a stage of 4 that answers STEPPED with no digest (a liar, or any replica that
cannot answer: behind, a joiner, crashed right after its step) keeps a 2-1 split of the honest three alive.

`need` is a strict majority of the whole round group (3 of 4): the split relay 3 sees {D2: [3]},
{D1: [5, 7]} and never takes D1; relays 5 and 7 see {D1: [5|7, 7|5]}. The commit's own scenario
(tests/test_stage_churn.py ..._takes_the_majoritys_weights...) with relay 1 (stage 2) silent on STEPPED.
Expected on 496b700: FAIL (no resync, stage 2 ends with two weights digests among honest replicas).
Run: cd <worktree> && PYTHONPATH=$PWD nice -n 15 python /work/wt/reviews/s26-RW-scripts/f1_one_silent_member_keeps_the_split.py [steps] [slow|control|minority]
(`minority`, against 6d4b4bf's majority of those that answered: the liar claims the split replica's digest: 2-2.)
With RW_TASK=chars-gpt (the presets' GPT, Adam) the split replica validates with its own weights: honest bans.
(`slow`: the liar answers None just before the asker's 2.5 s timeout: every forward of the stage waits for it.)
"""
import asyncio
import sys

from common import ChurnConfig, _config, gpt, encode, lie_on_stepped, relay, report, split_at, stage_digests

from phalanx.runs.pipeline.run import simulate_pipeline

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
slow = len(sys.argv) > 2 and sys.argv[2] == "slow"  # the liar answers only as the asker gives up (2.5 s)
control = len(sys.argv) > 2 and sys.argv[2] == "control"  # no liar: the commit's own test
minority = len(sys.argv) > 2 and sys.argv[2] == "minority"  # the liar claims the least-held digest (a tie, 6d4b4bf)
config = gpt(_config(ChurnConfig(), steps=steps))
split, liar = relay(config, 3), relay(config, 1)
split_at(config, split)


async def least_held(node, version):
    others = [p for p in node.groups[node.stage] if p != node.me]
    answers = await asyncio.gather(*(node._stepped_from(p, version) for p in others))
    held: dict[bytes, int] = {}
    for _, d in answers:
        if d is not None:
            held[d] = held.get(d, 0) + 1
    return min(held, key=held.get) if held else None


async def silent(node, sender, version, full):
    if minority and not full:
        return encode({"digest": await least_held(node, version)})
    if slow:
        await asyncio.sleep(node.config.complete_timeout / 2 - 0.01)
    return encode({"digest": None})


if not control:
    lie_on_stepped(liar, silent)
summary = simulate_pipeline(config, progress=False)
report(summary)
honest = {p: d for p, d in stage_digests(summary, 2).items() if p != liar}
banned_honest = [p for p in summary["banned"] if p != liar]
ok = len(set(honest.values())) == 1 and not banned_honest
print("honest replicas banned:", [p[:8] for p in banned_honest])
print("iteration durations:", [round(m["duration"], 2) for m in summary["metrics"]])
print("honest stage-2 replicas hold one model:", ok)
print("PASS" if ok else "FAIL: the split outlives agree_weights (one silent member of 4), or an honest replica is banned")
