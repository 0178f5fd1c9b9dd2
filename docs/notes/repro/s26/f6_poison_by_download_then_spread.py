"""RW s26 f6: no split needed. An honest replica whose machine stalls once (6 s, as its first forward of iteration
1 starts) is taken for dead, left out of iteration 1's group, and takes the stepped weights by download
(`fetch_weights` from the group, `Aggregation.aggregate`'s `fetched`). The liar (relay 1) is its first source (sources are sorted) and serves the honest parameters
(their digest is confirmed by relay 5, as `_confirmed` asks) with a poisoned optimizer state: the state is
not part of any digest (pre-existing in `fetch_weights`). The caught-up replica steps at iteration 2 with it and
holds weights nobody else holds; from then on the liar claims that replica's digest in STEPPED: 2 of 3, a strict
majority, so relay 5 (and the liar's own honest code) take the poisoned weights and state (new in 496b700).
Stage of 3 (peers=7): relays 1 (liar), 3 (stalls once), 5. `control`: the same stall, no liar.
Expected on 496b700: FAIL (stage 2 on the liar's optimizer state: the loss blows up).
Run: [RW_TASK=chars-gpt] cd <worktree> && PYTHONPATH=$PWD nice -n 15 python /work/wt/reviews/s26-RW-scripts/f6_poison_by_download_then_spread.py [steps] [control]
"""
import asyncio
import sys

import torch
from common import ChurnConfig, _config, encode, gpt, lie_on_stepped, relay, replace, report

from phalanx.core.serialization import decode
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.pipeline.node import PipelineNode

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
control = len(sys.argv) > 2 and sys.argv[2] == "control"
config = gpt(replace(_config(ChurnConfig(), steps=steps), peers=7))
liar, late = relay(config, 1), relay(config, 3)
served: list[tuple] = []
victims: list[str] = []


agreed = PipelineNode.weights_agreed


async def slow_once(self, version):  # relay 3's machine stalls 6 s as its first forward of iteration 1 starts
    if self.me == late and version == 1 and not getattr(self, "_rw_stalled", False):
        self._rw_stalled = True
        await asyncio.sleep(6.0)
    return await agreed(self, version)


def poison(state: dict) -> dict:
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, entry in state.items():
        entry = dict(entry)
        if isinstance(entry.get("momentum_buffer"), torch.Tensor):
            buf = entry["momentum_buffer"]
            entry["momentum_buffer"] = buf + 30.0 * torch.sign(torch.randn(buf.shape, generator=g))
        if isinstance(entry.get("exp_avg"), torch.Tensor):
            entry["exp_avg"] = torch.sign(torch.randn(entry["exp_avg"].shape, generator=g))
            entry["exp_avg_sq"] = torch.zeros_like(entry["exp_avg_sq"])
        out[name] = entry
    return out


honest_weights = PipelineNode._on_weights


async def on_weights(self, sender, payload):
    answer = await honest_weights(self, sender, payload)
    if self.me != liar:
        return answer
    body = decode(answer, self.me, self.transport.limits)
    if isinstance(body, dict) and "state" in body:  # a full answer: the honest parameters, a poisoned state
        served.append((sender[:8], body["version"]))
        victims.append(sender)
        body = dict(body, state=poison(body["state"]))
    return encode(body)


async def stepped_answer(node, sender, version, full):
    if victims:  # the victim's digest (its weights and state: full answers relayed from it) to everyone
        _, held = await node._stepped_from(victims[0], version, full=full)
        if full:
            return encode(held if isinstance(held, dict) else {"digest": None})
        return encode({"digest": held if held is not None else node.stepped.get(version)})
    return encode({"digest": node.stepped.get(version)} if not full else {"digest": None})


PipelineNode.weights_agreed = slow_once
if not control:
    PipelineNode._on_weights = on_weights
    lie_on_stepped(liar, stepped_answer)
summary = simulate_pipeline(config, progress=False)
report(summary)
print("liar served poisoned state by download to (peer, version):", served)
print("downloads:", [(e["peer"][:8], e["version"]) for e in summary["events"] if e["kind"] == "download"])
losses = [m["loss"] for m in summary["metrics"] if m.get("loss") is not None]
print(f"first loss {losses[0]:.3f}, min {min(losses):.3f}, last {losses[-1]:.3f}")
ok = max(losses[2:-1]) < losses[0] + 0.05 and not [p for p in summary["banned"] if p != liar]
print("PASS" if ok else "FAIL: the stage took the liar's optimizer state (by download, then by agree_weights)")
