"""RW s26 f3: a different answer to each asker. In a stage of 3 whose two honest replicas split (relay 3 at
iteration 1, as in the commit's test), the liar (relay 1) asks both for their digests (and full weights),
then tells each honest replica the OTHER's digest: each sees a strict majority (the other + the liar, 2 of 3)
and takes the other's weights. The two swap, stay apart, and the liar does it again at every step.
Control (`control`: no liar): the split heals at version 2 and stays healed.
Expected on 496b700: FAIL (two resyncs per version, stage 2's honest replicas never hold one model).
With RW_TASK=chars-gpt (the presets' GPT, whose stage gradients depend on the stage's weights) the kept split
turns into honest `gradient` / `slander:gradient` bans within a few steps.
Run: [RW_TASK=chars-gpt] cd <worktree> && PYTHONPATH=$PWD nice -n 15 python /work/wt/reviews/s26-RW-scripts/f3_swap_keeps_the_split.py [steps] [control|attack] [share]
"""
import asyncio
import sys

from common import ChurnConfig, _config, gpt, encode, lie_on_stepped, relay, replace, report, split_at, stage_digests

from phalanx.runs.pipeline.run import simulate_pipeline

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
control = len(sys.argv) > 2 and sys.argv[2] == "control"
share = int(sys.argv[3]) if len(sys.argv) > 3 else 4  # 1/share of relay 3's update is zeroed at iteration 1
config = gpt(replace(_config(ChurnConfig(), steps=steps), peers=7))
split, liar = relay(config, 3), relay(config, 1)
split_at(config, split, share=share)
views: dict[int, asyncio.Future] = {}  # version -> {peer: (digest, full body)} of the honest replicas, asked once
told: dict[tuple[str, int], bytes] = {}


async def learn(node, version):
    others = [p for p in node.groups[node.stage] if p != node.me]
    digests = await asyncio.gather(*(node._stepped_from(p, version) for p in others))
    bodies = await asyncio.gather(*(node._stepped_from(p, version, full=True) for p in others))
    return {p: (d, b) for (p, d), (_, b) in zip(digests, bodies) if d is not None}


async def liar_answer(node, sender, version, full):
    if version not in views:
        views[version] = asyncio.ensure_future(learn(node, version))
    view = await views[version]
    if full:
        wanted = told.get((sender, version))
        body = next((b for d, b in view.values() if d == wanted and isinstance(b, dict)), None)
        return encode(body if body is not None else {"digest": None})
    own = view.get(sender, (None, None))[0]
    other = next((d for p, (d, _) in view.items() if p != sender and d != own), None)
    answer = other if other is not None else node.stepped.get(version)
    told[(sender, version)] = answer
    return encode({"digest": answer})


if not control:
    lie_on_stepped(liar, liar_answer)
summary = simulate_pipeline(config, progress=False)
report(summary)
honest = {p: d for p, d in stage_digests(summary, 2).items() if p != liar}
banned_honest = [p for p in summary["banned"] if p != liar]
ok = len(set(honest.values())) == 1 and not banned_honest
print("honest stage-2 replicas (of those at the last version) hold one model:", len(set(honest.values())) == 1)
print("honest replicas banned:", [p[:8] for p in banned_honest])
print("PASS" if ok else "FAIL: the liar keeps the honest replicas apart (they swap weights every step) or they are banned")
