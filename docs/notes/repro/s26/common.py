"""Shared scaffolding of reviewer RW's session-26 scripts (run from a worktree root with PYTHONPATH=$PWD).

The split is made as the commit's own test makes it: relay 3 (stage 2) steps at iteration 1 with a quarter
of its update zeroed, with no trace in its round. Each script then adds one adversary that runs the
STEPPED protocol and lies in it (`PipelineNode._on_stepped` patched for the liar's identity only)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

sys.path.insert(0, os.getcwd())

from phalanx.core.serialization import decode, encode  # noqa: E402
from phalanx.runs.dp.swarm import peer_identity  # noqa: E402
from phalanx.runs.pipeline.config import ChurnConfig  # noqa: E402
from phalanx.runtime.pipeline.node import PipelineNode  # noqa: E402
from phalanx.runtime.pipeline.stage_btard import StageRound  # noqa: E402
from tests.test_stage_churn import _config  # noqa: E402


def gpt(config):
    """RW_TASK=chars-gpt: the GPT task of the presets (Adam), whose stage gradients depend on the stage's own
    weights (a digits-MLP stage is one linear layer: its weight gradient barely does, so a split draws no claim)."""
    if os.environ.get("RW_TASK") != "chars-gpt":
        return config
    from phalanx.runtime.dp.peer import TrainConfig
    return replace(config, train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.003, batch_size=4))


def relay(config, r: int) -> str:
    return peer_identity(config.seed, config.data_nodes + r).peer_id


def split_at(config, who: str, it: int = 1, share: int = 4) -> None:
    """`who` steps at `it` with the first 1/share of its update zeroed (the commit's test's split)."""
    call = StageRound.__call__

    async def lacks_a_partition(self, i, vector, group):
        result = await call(self, i, vector, group)
        if self.node.me == who and i == it:
            result = replace(result, vector=result.vector.clone())
            result.vector[: result.vector.numel() // share] = 0.0
        return result

    StageRound.__call__ = lacks_a_partition


def lie_on_stepped(liar: str, answer) -> None:
    """The liar answers STEPPED with `await answer(node, sender, version, full)` (bytes), others honestly."""
    honest = PipelineNode._on_stepped

    async def on_stepped(self, sender, payload):
        if self.me != liar:
            return await honest(self, sender, payload)
        obj = decode(payload, sender, self.transport.limits)
        return await answer(self, sender, obj["version"], obj["full"])

    PipelineNode._on_stepped = on_stepped


def stage_digests(summary, stage: int) -> dict[str, bytes]:
    return {p: d for p, (s, _, d) in summary["replicas"].items() if s == stage}


def report(summary, stage: int = 2) -> None:
    import json
    dump = os.environ.get("RW_DUMP")
    if dump:
        with open(dump, "w") as f:
            json.dump({"events": summary["events"], "metrics": summary["metrics"], "bans": summary["bans"]}, f, default=str)
    resyncs = [(e["peer"][:8], e["version"], e["from"][:8], e["majority"], e["group"]) for e in summary["events"]
               if e["kind"] == "resync"]
    print("resyncs (peer, version, from, majority, group):", resyncs)
    print("bans:", [(b.get("peer", "")[:8], b.get("step"), b.get("reason")) for b in summary["bans"]] if summary["bans"] and
          isinstance(summary["bans"][0], dict) else summary["bans"])
    print("banned:", [p[:8] for p in summary["banned"]])
    print(f"stage {stage} digests:", {p[:8]: d.hex()[:8] if isinstance(d, bytes) else str(d)[:8]
                                      for p, d in stage_digests(summary, stage).items()})
    kinds: dict[str, int] = {}
    for e in summary["events"]:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    print("event kinds:", dict(sorted(kinds.items())))
    claims = [(e["peer"][:8], e["step"], e["by"][:8], [g.get("gap") for g in e.get("gradient", [])]) for e in summary["events"]
              if e["kind"] == "claim"]
    print("gradient claims (target, step, by, gap):", claims)
    print("loss per iteration:", [round(m["loss"], 3) if m.get("loss") is not None else None for m in summary["metrics"]])


__all__ = ["ChurnConfig", "_config", "gpt", "encode", "relay", "split_at", "lie_on_stepped", "stage_digests", "report", "replace"]
