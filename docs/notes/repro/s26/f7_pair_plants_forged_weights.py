"""RW s26 f7 (against 6d4b4bf): "a strict majority of the members that answered" lets a colluding pair of a stage
of 5 (2 of 5: within f < n / 2) plant weights that no honest replica stepped to, whenever the two other honest
replicas give no digest in time (late by more than complete_timeout / 2, or behind: a replica that took the
version without stepping now answers None at once). The on-time honest replica A then counts {A: D, pair: X}:
3 answered, X held by 2 > 3 / 2, and takes X (the pair serves forged parameters and state whose digest is X).
From then on the pair claims A's digest: 3 of 5 (A + pair), a strict majority of everybody, so the other honest
replicas take A's forged weights as soon as they step and check.

Stage 2 of 5 (peers=11): relays 1 and 3 collude, relay 5 steps on time, relays 7 and 9 are honest and late once
(their round of iteration 1 ends 3 s after the others', a loaded moment). The forgery: the pair's own honest
weights + 0.5 * sign(noise) per coordinate (any weights would do). `control`: the same late step, no pair.
Expected on 6d4b4bf: FAIL (relay 5 takes the forged weights; then the stage follows; the loss goes up).
Run: [RW_TASK=chars-gpt] cd <worktree at 6d4b4bf> && PYTHONPATH=$PWD nice -n 15 python \
    /work/wt/reviews/s26-RW-scripts/f7_pair_plants_forged_weights.py [steps] [control]
"""
import asyncio
import sys

import torch
from common import ChurnConfig, _config, encode, gpt, relay, replace, report, stage_digests

from phalanx.core.serialization import decode
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.pipeline.node import PipelineNode
from phalanx.runtime.pipeline.stage_btard import StageRound
from phalanx.runtime.pipeline.weights import weights_and_state_digest

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
control = len(sys.argv) > 2 and sys.argv[2] == "control"
config = gpt(replace(_config(ChurnConfig(), steps=steps), peers=11))
pair = {relay(config, 1), relay(config, 3)}
late = {relay(config, 7), relay(config, 9)}
call = StageRound.__call__
honest_stepped = PipelineNode._on_stepped
forged: dict[int, dict] = {}  # version -> the pair's forged body (both claim and serve the same)
victims: list[str] = []
planted: list[tuple] = []


async def slow_once(self, it, vector, group):
    result = await call(self, it, vector, group)
    if self.node.me in late and it == 1:
        await asyncio.sleep(3.0)
    return result


def forge(node, version):
    if version not in forged:
        g = torch.Generator().manual_seed(1000 + version)
        params = [(p.detach() + 0.5 * torch.sign(torch.randn(p.shape, generator=g))).contiguous() for p in node.params]
        state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in e.items()}
                 for i, e in node.optimizer.state_dict()["state"].items()}
        forged[version] = {"digest": weights_and_state_digest(params, state), "params": params,
                           "state": {str(i): e for i, e in state.items()}}
    return forged[version]


async def on_stepped(self, sender, payload):
    if self.me not in pair:
        return await honest_stepped(self, sender, payload)
    obj = decode(payload, sender, self.transport.limits)
    version, full = obj["version"], obj["full"]
    if victims and sender not in pair:  # after the plant: the victim's digest (and weights, relayed) to everyone
        _, body = await self._stepped_from(victims[0], version, full=full)
        if full:
            return encode(body if isinstance(body, dict) else {"digest": None})
        return encode({"digest": body})
    if version < 2:
        return await honest_stepped(self, sender, payload)
    body = forge(self, version)
    if full:
        victims.append(sender)
        planted.append((sender[:8], version, round(self.now(), 2)))
        return encode(body)
    return encode({"digest": body["digest"]})


StageRound.__call__ = slow_once
if not control:
    PipelineNode._on_stepped = on_stepped
summary = simulate_pipeline(config, progress=False)
report(summary)
print("forged weights taken by (peer, version, t):", planted)
honest = {p: d for p, d in stage_digests(summary, 2).items() if p not in pair}
losses = [m["loss"] for m in summary["metrics"] if m.get("loss") is not None]
print(f"first loss {losses[0]:.3f}, min {min(losses):.3f}, last {losses[-1]:.3f}")
ok = not planted and not [p for p in summary["banned"] if p not in pair]
print("PASS" if ok else "FAIL: the pair planted weights no honest replica stepped to")
