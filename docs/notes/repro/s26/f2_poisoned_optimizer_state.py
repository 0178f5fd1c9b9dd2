"""RW s26 f2: `_take_stepped` checks the digest of the parameters only and copies the source's optimizer state
as served. A liar of a stage of 3 makes itself the source and serves the honest parameters (the digest holds)
with a poisoned momentum; the honest replica that took them steps off a cliff at its next step, and from then
on the liar claims THAT replica's digest to everybody: with the liar's vote it is a strict majority (2 of 3),
so the other honest replica (and the liar's own honest code) take the poisoned weights and state too.

How the liar becomes the source: stage 2's honest replicas O and S split (relay 3 at iteration 1, as in the
commit's test). The liar (relay 1) learns both digests and full weights (STEPPED, as any member may), tells O
(the first to ask) S's digest at once (O takes S's weights: S + liar are 2 of 3), and tells S O's OLD digest
only once O has taken S's weights. S then asks O first (O answered first) and O no longer holds its old weights
(`held` is now S's digest): S falls back on the liar, which serves O's old parameters with its momentum.
Setup: 1 data node + 2 stages x 3 relays (tests/test_stage_churn.py `_config`, peers=7; SGD, momentum 0.9,
lr 0.1). Control (`control`: no liar): the split heals (one resync) and the loss falls as in the commit's test.
Expected on 496b700: FAIL (the liar served poisoned state; stage 2's loss goes up instead of down).
With RW_TASK=chars-gpt: the presets' GPT task with Adam (the poison is then a first moment of +-1 with no second
moment).
Run: [RW_TASK=chars-gpt] cd <worktree> && PYTHONPATH=$PWD nice -n 15 python /work/wt/reviews/s26-RW-scripts/f2_poisoned_optimizer_state.py [steps] [control]
"""
import asyncio
import sys

import torch
from common import ChurnConfig, _config, gpt, encode, lie_on_stepped, relay, replace, report, split_at

from phalanx.runs.pipeline.run import simulate_pipeline

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
control = len(sys.argv) > 2 and sys.argv[2] == "control"
config = gpt(replace(_config(ChurnConfig(), steps=steps), peers=7))
split, liar = relay(config, 3), relay(config, 1)
split_at(config, split)
views: dict[int, asyncio.Future] = {}  # version -> {peer: (digest, full body)}: the honest replicas, asked once
told: dict[tuple[str, int], bytes] = {}
first: dict[int, str] = {}  # version -> the first honest asker (O)
victims: list[str] = []  # the honest replica the liar served poisoned state to (S)
served: list[tuple] = []


def poison(state: dict) -> dict:
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, entry in state.items():
        entry = dict(entry)
        buf = entry.get("momentum_buffer")  # SGD: a momentum of +-30 per coordinate
        if isinstance(buf, torch.Tensor):
            entry["momentum_buffer"] = buf + 30.0 * torch.sign(torch.randn(buf.shape, generator=g))
        if isinstance(entry.get("exp_avg"), torch.Tensor):  # Adam: a first moment of +-1, no second moment
            entry["exp_avg"] = torch.sign(torch.randn(entry["exp_avg"].shape, generator=g))
            entry["exp_avg_sq"] = torch.zeros_like(entry["exp_avg_sq"])
        out[name] = entry
    return out


async def learn(node, version):
    others = [p for p in node.groups[node.stage] if p != node.me]
    digests = await asyncio.gather(*(node._stepped_from(p, version) for p in others))
    bodies = await asyncio.gather(*(node._stepped_from(p, version, full=True) for p in others))
    return {p: (d, b) for (p, d), (_, b) in zip(digests, bodies) if d is not None}


async def liar_answer(node, sender, version, full):
    if victims:  # the poisoned replica's digest to everyone; its full weights relayed (its state is the poisoned one)
        victim = victims[0]
        if full:
            _, body = await node._stepped_from(victim, version, full=True)
            return encode(body if isinstance(body, dict) else {"digest": None})
        _, held = await node._stepped_from(victim, version)  # to the victim too: its own digest has 2 of 3
        return encode({"digest": held if held is not None else node.stepped.get(version)})
    if version not in views:
        views[version] = asyncio.ensure_future(learn(node, version))
    view = await views[version]
    if full:
        wanted = told.get((sender, version))
        body = next((b for d, b in view.values() if d == wanted and isinstance(b, dict)), None)
        if body is None:
            return encode({"digest": None})
        served.append((sender[:8], version))
        victims.append(sender)
        return encode(dict(body, state=poison(body["state"])))
    own = view.get(sender, (None, None))[0]
    other = next(((p, d) for p, (d, _) in view.items() if p != sender and d != own), None)
    if other is None:
        return encode({"digest": node.stepped.get(version)})
    first.setdefault(version, sender)
    if first[version] != sender:  # S: wait until O took S's weights, then name O's old digest
        o = first[version]
        for _ in range(40):
            _, held = await node._stepped_from(o, version)
            if held == own:
                break
            await asyncio.sleep(0.05)
    told[(sender, version)] = other[1]
    return encode({"digest": other[1]})


if not control:
    lie_on_stepped(liar, liar_answer)
summary = simulate_pipeline(config, progress=False)
report(summary)
print("liar served poisoned state to (peer, version):", served)
losses = [m["loss"] for m in summary["metrics"] if m.get("loss") is not None]
ok = bool(losses) and max(losses[2:-1]) < losses[0] + 0.05
print(f"first loss {losses[0]:.3f}, last {losses[-1]:.3f}")
print("PASS" if ok else "FAIL: an honest replica took the liar's optimizer state (and the stage followed it)")
