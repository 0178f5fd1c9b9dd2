"""RP finding 4: after two repairs of one microbatch (stage 2, then stage 1 of the repaired path), `expected_slots`
wants the forward verdict (new stage-1 node -> stage-2 repair node), a tensor that never crossed link 1 (the second
repair's last rebuilt stage resumes, it does not send), and not the one that did cross (old stage-1 node -> stage-2
repair node). The microbatch waits out verdict_timeout and is deferred. Scenario: the helper's off-path repair test
(stage-2 relay leaves 15 ms after its first backward of iteration 1); when the holder accepts the repair's RESUME,
the stage-1 relay of that path leaves too, so the repair node's gradient finds it gone (a broken backward at stage 1).
Run: cd /work/wt/rP && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python <this file>
"""
import sys

sys.path.insert(0, "tests")
from test_sentinel_off_path import _repair_config  # noqa: E402

from phalanx.runs.pipeline.run import simulate_pipeline  # noqa: E402
from phalanx.runtime.pipeline import messages as m  # noqa: E402
from phalanx.runtime.pipeline.data_node import expected_slots  # noqa: E402
from phalanx.runtime.pipeline.repair import Repair  # noqa: E402

net: list = []
crashed: list = []
on_resume = Repair._on_resume


async def on_resume_then_crash(self, sender: str, payload: bytes) -> bytes:
    answer = await on_resume(self, sender, payload)
    obj = m.parse_mapping(payload, sender, self.transport.limits, "resume")
    if not crashed and m.parse_answer(answer, sender, self.transport.limits) == m.OK:
        crashed.append(obj["path"][1])  # the stage-1 relay the repair node will send its gradient to
        net[0].crash(obj["path"][1])
    return answer


Repair._on_resume = on_resume_then_crash
config = _repair_config(crash_stage=2, crash_iteration=1, crash_at=0.015, crash_after="bwd")
s = simulate_pipeline(config, progress=False, adversary=lambda network, directory: net.append(network))
print("second relay crashed:", [p[:8] for p in crashed])
for mb in s["microbatches"]:
    if mb["repairs"] or mb["outcome"] != "ok":
        print(f"  it {mb['it']} seq {mb['seq']} att {mb['att']}: outcome={mb['outcome']} repairs={mb['repairs']} "
              f"restarts={mb['restarts']} recomputed={mb['recomputed']} path={[p[:8] for p in mb['path']]}")
for e in s["events"]:
    if e["kind"] == "unverified":
        print("  unverified:", e["mb"], "links", e["links"], "flagged", e["flagged"])
print("completed per iteration:", [r["completed"] for r in s["metrics"]])
loss_path, path = ("D", "a", "b", "c"), ("D", "a2", "n", "c")
print("expected_slots(D a b c -> D a2 n c):", [x for x in expected_slots(loss_path, path, 3, "D") if x[0] == "forward"])
if any(e["kind"] == "unverified" and not e["flagged"] for e in s["events"]):
    print("FAIL: an honest twice-repaired microbatch was deferred for a verdict on a tensor that never crossed a link")
