"""Every BTARD protocol attack as a lying replica of a pipeline stage (BTARD per stage, simulator).

    PYTHONPATH=. python bench/stage_btard_catalogue.py [--attacks a,b] [--steps 7] [--liars 1]

One data node + 2 stages x 4 relays (digits MLP, 8 microbatches, capacity 2, CenteredClip tau 1);
the liars (relays 1, 3, ...: stage 2) run the attack from iteration 2. Prints, per attack: the banned
set against the liars, honest replicas banned, the reasons, the iteration of the first ban, the final
loss against the clean run, and whether the honest replicas of each stage end identical.
Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx.algorithms.btard.attacks import PROTOCOL_ATTACKS  # noqa: E402
from phalanx.runs.pipeline.config import PipelineRunConfig, StageByzantineConfig  # noqa: E402
from phalanx.runs.pipeline.run import simulate_pipeline  # noqa: E402
from phalanx.runtime.dp.peer import TrainConfig  # noqa: E402
from phalanx.runtime.pipeline.config import PipelineConfig  # noqa: E402
from phalanx.runtime.rounds.btard import BTARDConfig  # noqa: E402
from phalanx.runtime.rounds.butterfly import AllReduceConfig  # noqa: E402

START = 2


def config(attack: str, steps: int, liars: int) -> PipelineRunConfig:
    relays = ",".join(str(1 + 2 * i) for i in range(liars)) if attack != "none" else ""
    return PipelineRunConfig(
        peers=9, data_nodes=1, steps=steps,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=2, microbatches=8, capacity=2),
        allreduce=AllReduceConfig(reducer="centered_clip", tau=1.0),
        btard=BTARDConfig(enabled=True, validators=0, timeout=1.0),
        byzantine=StageByzantineConfig(attack=attack, relays=relays, start_step=START),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attacks", default=",".join(PROTOCOL_ATTACKS))
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--liars", type=int, default=1)
    args = parser.parse_args()
    clean = simulate_pipeline(config("none", args.steps, args.liars), progress=False)
    clean_loss = clean["metrics"][-1]["loss"]
    print(f"clean: banned {clean['banned'] or 'none'}, final loss {clean_loss:.4f}, simulated {clean['simulated_seconds']:.3f} s")
    print(f"{'attack':20s} {'liars banned':>12s} {'honest banned':>13s} {'first ban':>9s} {'loss':>7s} {'agree':>5s}  reasons")
    for attack in args.attacks.split(","):
        cfg = config(attack, args.steps, args.liars)
        s = simulate_pipeline(cfg, progress=False)
        liars = {s["peer_ids"][cfg.data_nodes + i] for i in cfg.byzantine.indices}
        banned = set(s["banned"])
        reasons = sorted({b["reason"] for b in s["bans"]})
        first = min((b["step"] for b in s["bans"]), default=None)
        digests = defaultdict(set)
        for peer, (stage, _, digest) in s["replicas"].items():
            if peer not in liars:
                digests[stage].add(digest)
        agree = all(len(d) == 1 for d in digests.values())
        loss = s["metrics"][-1]["loss"]
        print(f"{attack:20s} {len(banned & liars):>10d}/{len(liars)} {len(banned - liars):>13d} {str(first):>9s} "
              f"{loss:7.4f} {str(agree):>5s}  {', '.join(reasons)}")


if __name__ == "__main__":
    main()
