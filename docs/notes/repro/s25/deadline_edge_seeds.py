"""Session 24's red-team violations (a `deadline_edge` colluder's own partition left out at no cost), replayed.

Each seed's commitment is signed at 0.95 btard.timeout and sent to half of the others then, to the rest 0.1 T later:
late for most owners (its late drops are no claims: `late_for_most`), silent for most (its partition passed over
everywhere: `passed_over`), and nothing removes it. Open since session 24 (main 215a947 and session 25's final code).

Run: cd <checkout> && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python docs/notes/repro/s25/deadline_edge_seeds.py
(prints FAIL and exits 1 while any seed violates; about 10 s)
"""
from __future__ import annotations

import sys

from phalanx.benchmarks.btard_redteam import RedTeamConfig, run_trial

SEEDS = ((2700365, 3, "deadline_edge"), (2700079, 3, "deadline_edge"), (2700312, 6, "deadline_edge,commit,withhold_aggregate"))


def main() -> int:
    failed = False
    for seed, steps, points in SEEDS:
        trial = run_trial(seed, RedTeamConfig(steps=steps, max_peers=8, points=points))
        print(seed, trial.moves, trial.violations)
        failed |= bool(trial.violations)
    print("FAIL: a deadline_edge colluder's partition left out at no cost" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
