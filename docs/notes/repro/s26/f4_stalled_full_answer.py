"""RW s26 f4: a liar that is the first holder the minority replica tries answers the full request only just
before `aggregation_timeout`. The minority replica's forwards of the new version wait for the whole check
(`weights_agreed`), its iteration goes on without it, and the next BEGIN's `StageInputs.record` keeps its
*unhealed* weights for that step (kept.version == step: no CannotJudge): as a validator or judge of that step it
recomputes its honest peers' gradients with other weights than theirs.

Stage of 3 (peers=7): relay 3 splits at iteration 1 (as in the commit's test); relay 5 is honest and loaded, its
round ends `delay` (1.0) simulated seconds after the others' (so the liar's digest answer reaches relay 3 first,
as a nearer or less loaded liar's would); relay 1, the liar, answers digests honestly and full requests with
nothing, after aggregation_timeout - 0.5 s. Control (`control`: no liar): the split heals at version 2.
Expected on 496b700: FAIL (the split is not healed; relay 3's forwards stall; see the claims/bans printed).
`late-copy`: after a 6 s stall (the replica has moved on by then) the liar serves the true weights of the version asked (kept from when it was
asked); `_take_stepped` copies them whatever version the replica has reached meanwhile (no version check).
Run: [RW_TASK=chars-gpt] cd <worktree> && PYTHONPATH=$PWD nice -n 15 python /work/wt/reviews/s26-RW-scripts/f4_stalled_full_answer.py [steps] [control|late-copy]
"""
import asyncio
import sys

from common import ChurnConfig, _config, gpt, encode, lie_on_stepped, relay, replace, report, split_at, stage_digests

from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.pipeline.node import PipelineNode
from phalanx.runtime.pipeline.stage_btard import StageRound

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
control = len(sys.argv) > 2 and sys.argv[2] == "control"
late_copy = len(sys.argv) > 2 and sys.argv[2] == "late-copy"  # after the stall, serve the real weights of that version
config = gpt(replace(_config(ChurnConfig(), steps=steps), peers=7))
split, liar, late = relay(config, 3), relay(config, 1), relay(config, 5)
split_at(config, split)
call = StageRound.__call__
honest = PipelineNode._on_stepped
stalled: list[tuple] = []


async def slow(self, it, vector, group):
    result = await call(self, it, vector, group)
    if self.node.me == late and it >= 1:
        await asyncio.sleep(1.0)
    return result


async def liar_answer(node, sender, version, full):
    if not full:
        return await honest(node, sender, encode({"version": version, "full": False}))
    stalled.append((sender[:8], version, round(node.now(), 2)))
    body = None
    if late_copy and node.stepped.get(version) == node.state_digest():  # its own weights of `version`, kept
        body = {"digest": node.stepped[version], "params": [p.detach().clone() for p in node.params],
                "state": {str(i): {k: (v.clone() if hasattr(v, "clone") else v) for k, v in e.items()}
                          for i, e in node.optimizer.state_dict()["state"].items()}}
    await asyncio.sleep(6.0 if late_copy else node.config.aggregation_timeout - 0.5)  # late-copy: once it moved on
    return encode(body if body is not None else {"digest": None})


StageRound.__call__ = slow
if not control:
    lie_on_stepped(liar, liar_answer)
summary = simulate_pipeline(config, progress=False)
report(summary)
print("full requests the liar stalled (asker, version, t):", stalled)
print("iteration durations:", [round(m["duration"], 2) for m in summary["metrics"]])
digests = {p: d for p, d in stage_digests(summary, 2).items() if p != liar}
resynced = [(e["peer"][:8], e["version"], round(e["t0"], 2)) for e in summary["events"] if e["kind"] == "resync"]
behind = {e["peer"][:8]: e["version"] for e in summary["events"] if e["kind"] == "aggregate" and e["peer"] == split}
print("resync copies (peer, version copied, t):", resynced, "; relay 3's version then:", behind)
ok = len(set(digests.values())) == 1 and not [p for p in summary["banned"] if p != liar]
print("PASS" if ok else "FAIL: the stalled take leaves the split (and its consequences) in place")
