"""The same seeds give the same metrics.jsonl and bans.jsonl as the files in tests/golden/ (written by this tree before the
layout move of issue 17): one preset of each run kind, with a Byzantine side so that every defence runs.

On a CPU with the kernels the files were written with (torch's CPU capability, recorded beside them), the
bytes must be equal. Elsewhere torch may sum in another order, so the values must agree to 1e-4 and every
count, ban and flag exactly. Regenerate with `python tests/test_golden_metrics.py` only for an intended
change of behaviour, and say so in the commit."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import phalanx.api as px

GOLDEN = Path(__file__).resolve().parent / "golden"
# Wall-clock fields (real seconds, different on every run) are dropped before comparing.
WALL_CLOCK = {"coordinator_seconds", "detect_seconds"}
RUNS = {
    "data-parallel": ("btard-digits", {"steps": 4, "set": ["byzantine.count=3", "byzantine.attack=alie", "byzantine.start_step=1"]}),
    "pipeline": ("secure-gpt-pipeline", {"steps": 3, "set": ["byzantine.attack=agg_shift", "byzantine.relays=0"]}),
    "aspis": ("aspis-digits", {"steps": 3}),
}


def _metrics(kind: str, out: Path) -> str:
    preset, keys = RUNS[kind]
    px.simulate(px.config(preset, **keys), out=out)
    files = [out / "metrics.jsonl"] + [p for p in [out / "bans.jsonl"] if p.exists()]
    rows = [json.loads(line) for path in files for line in path.read_text().splitlines()]
    return "".join(json.dumps({k: v for k, v in row.items() if k not in WALL_CLOCK}, sort_keys=True) + "\n" for row in rows)


def _close(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_metrics_equal_the_golden_run(kind, tmp_path):
    got = _metrics(kind, tmp_path / kind)
    want = (GOLDEN / f"{kind}.jsonl").read_text()
    if (GOLDEN / "cpu.txt").read_text().strip() == torch.backends.cpu.get_cpu_capability():
        assert got == want
    else:
        rows = [(json.loads(g), json.loads(w)) for g, w in zip(got.splitlines(), want.splitlines())]
        assert len(got.splitlines()) == len(want.splitlines())
        assert [g for g, w in rows if not _close(g, w)] == []


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for kind in sys.argv[1:] or sorted(RUNS):
            (GOLDEN / f"{kind}.jsonl").write_text(_metrics(kind, Path(tmp) / kind))
    (GOLDEN / "cpu.txt").write_text(torch.backends.cpu.get_cpu_capability() + "\n")
