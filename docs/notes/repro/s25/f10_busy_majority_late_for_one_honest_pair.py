"""RB s25 finding 10 (task 2's launch pair, rebuilt with busy loops; e5724c6's anchor does not close it): stage of six,
all honest (relays 1, 3, 5, 7, 9, 11; peers=13, T = 2.5 s). At iteration IT relays 1, 3, 5, 7 commit on time and then
their loops are busy for B x T (over hivemind compute runs on the event loop): the others' commitments reach their
boards only then, so their anchor (the 4th arrival on their own board) and deadline are B x T later than relay 9's,
which reads its stream. Relay 11 begins D x T late (a loaded machine; it does not step out: only relay 9 has declared
when it commits): its commitment is late for relay 9 only (1 of 5 owners, not late for most), and relay 9's drop
is an ELIMINATE of two honest relays.

Run: cd <checkout> && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python /work/wt/reviews/s25-RB-scripts/f10_busy_majority_late_for_one_honest_pair.py [B D]
"""
from __future__ import annotations

import asyncio
import sys

from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.pipeline.config import ChurnConfig, PipelineRunConfig, StageByzantineConfig
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runtime.dp.peer import TrainConfig
from phalanx.runtime.pipeline.config import PipelineConfig
from phalanx.runtime.pipeline.stage_btard import _StageBoard
from phalanx.runtime.rounds.btard import BTARDConfig, SecureRound
from phalanx.runtime.rounds.butterfly import AllReduceConfig

IT = 3


def main() -> int:
    busy_for, late_by = (float(sys.argv[1]), float(sys.argv[2])) if len(sys.argv) > 2 else (0.5, 1.2)
    config = PipelineRunConfig(
        peers=13, data_nodes=1, steps=5,
        train=TrainConfig(task="digits-mlp", batch_size=8, lr=0.1),
        pipeline=PipelineConfig(stages=2, microbatches=8, capacity=2),
        allreduce=AllReduceConfig(reducer="centered_clip", tau=1.0),
        btard=BTARDConfig(enabled=True, validators=2, timeout=2.5),
        byzantine=StageByzantineConfig(attack="none", relays="", start_step=2),
        faults=ChurnConfig(),
    )
    T = config.btard.timeout
    pid = {r: peer_identity(config.seed, r + 1).peer_id for r in range(12)}
    names = {v: f"relay{r}" for r, v in pid.items()}
    busy = {pid[r] for r in (1, 3, 5, 7)}
    join, commitments, add = SecureRound._join, SecureRound._commitments, _StageBoard.add
    blocked: dict = {}  # board -> (owner id, queued envelopes)

    def unread_while_busy(self, envelope):
        entry = blocked.get(id(self))
        if entry is not None and envelope.topic == "bt.commit" and envelope.sender != entry[0]:
            entry[1].append(envelope)
            return False
        return add(self, envelope)

    async def busy_after_commit(self, st):
        me = self.transport.peer_id
        if st.step == IT and me in busy:
            board = self.transport.board
            blocked[id(board)] = (me, [])

            def release():
                _, queue = blocked.pop(id(board))
                for envelope in queue:
                    add(board, envelope)

            asyncio.get_running_loop().call_later(busy_for * T, release)
        return await commitments(self, st)

    async def late_start(self, step, candidates):
        if step == IT and self.transport.peer_id == pid[11]:
            await asyncio.sleep(late_by * T)
        return await join(self, step, candidates)

    SecureRound._join, SecureRound._commitments, _StageBoard.add = late_start, busy_after_commit, unread_while_busy
    try:
        summary = simulate_pipeline(config, progress=False)
    finally:
        SecureRound._join, SecureRound._commitments, _StageBoard.add = join, commitments, add
    print("bans:", sorted({(names.get(b["peer"], b["peer"][:6]), b["reason"]) for b in summary["bans"]}))
    print("banned:", sorted(names.get(p, p[:6]) for p in summary["banned"]), "retired:", sorted(names.get(p, p[:6]) for p in summary["retired"]))
    if summary["banned"]:
        print(f"FAIL: every relay is honest; banned: {sorted(names.get(p, p[:6]) for p in summary['banned'])}")
        return 1
    print("ok: no honest relay banned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
