"""Where a BTARD step's wall time goes over hivemind: a timestamp trace of one peer process, and its phase table.

`install(path)` wraps, in this process only, the round's phases, the transport's broadcast, collect, fetch
and stream exchange, the board's arrivals, signing and signature checks and the validators' recomputation,
and starts a monitor of the event loop's lag; each writes one JSON line to `path` (times: `time.monotonic`,
one clock for every process of the machine, so arrivals compare across peers). `bench/btard_overhead.py
--trace DIR` installs it in each hivemind worker; then

    PYTHONPATH=. python bench/btard_trace.py DIR

prints the phase table (mean ms per step over the measured steps, per peer, and the broadcast rounds: first
send to first and last delivery). Tracing adds a few microseconds per wrapped call; nothing here changes
what the round does.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAG_PERIOD = 0.002  # the lag monitor's sleep; a wake-up later than this by LAG_REPORTED is written down
LAG_REPORTED = 0.005


class Trace:
    def __init__(self, path: Path) -> None:
        self._file = open(path, "w")

    def write(self, kind: str, start: float, end: float | None = None, **fields) -> None:
        self._file.write(json.dumps({"kind": kind, "t0": start, "t1": start if end is None else end, **fields}) + "\n")

    def close(self) -> None:
        self._file.close()


_trace: Trace | None = None


def _span_async(owner, name: str, kind: str, fields):
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    async def wrapped(*args, **kwargs):
        start = time.monotonic()
        try:
            return await original(*args, **kwargs)
        finally:
            if _trace is not None:
                _trace.write(kind, start, time.monotonic(), **fields(*args, **kwargs))

    setattr(owner, name, wrapped)


def _span_sync(owner, name: str, kind: str, fields=lambda *a, **k: {}):
    original = getattr(owner, name, None)
    if original is None:
        return
    static = isinstance(owner.__dict__.get(name), (classmethod, staticmethod)) if isinstance(owner, type) else False

    def wrapped(*args, **kwargs):
        start = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            if _trace is not None:
                _trace.write(kind, start, time.monotonic(), **fields(*args, **kwargs))

    setattr(owner, name, classmethod(lambda cls, *a, **k: wrapped(*a, **k)) if static else functools.wraps(original)(wrapped))


def _step_of(st) -> dict:
    return {"step": st.step}


def install(path: Path, me: str) -> None:
    """Wrap the round, the transport and the board of peer `me`'s process; write the trace to `path`."""
    global _trace
    from phalanx.core.envelope import SignedEnvelope
    from phalanx.runtime.rounds import btard, btard_verify
    from phalanx.runtime.rounds.butterfly import ButterflyAllReduce
    from phalanx.transport import p2p
    from phalanx.transport.base import Transport
    from phalanx.transport.broadcast import BroadcastBoard

    _trace = Trace(path)
    _trace.write("peer", time.monotonic(), peer=me[:8])
    secure = btard.SecureRound
    _span_async(secure, "_join", "join", lambda self, step, *a, **k: {"step": step})
    _span_async(secure, "_commit", "commit", lambda self, st, *a, **k: _step_of(st))
    _span_async(secure, "_scatter", "scatter", lambda self, st, *a, **k: _step_of(st))
    _span_async(secure, "_reduce", "reduce", lambda self, st, *a, **k: _step_of(st))
    _span_async(secure, "_gather", "gather", lambda self, st, *a, **k: _step_of(st))
    _span_async(secure, "_verify", "verify", lambda self, st, *a, **k: _step_of(st))
    _span_async(secure, "settle", "settle", lambda self, step=None, *a, **k: {"step": step})
    _span_async(ButterflyAllReduce, "_collect", "ar_collect", lambda self, step, kind, *a, **k: {"step": step, "what": kind})
    _span_async(btard, "draw", "mprng", lambda state, mprng, entropy, step, *a, **k: {"step": step})
    _span_async(btard_verify, "_check", "check", lambda state, st, *a, **k: _step_of(st))
    _span_async(btard_verify, "validate", "validate", lambda state, st, target, *a, **k: _step_of(st))
    _span_async(btard_verify, "_agreed_reports", "agreed_reports", lambda state, st, *a, **k: _step_of(st))
    _span_async(btard_verify, "_compare_views", "compare_views", lambda state, st, *a, **k: _step_of(st))
    _span_async(btard_verify, "_agreed_checks", "agreed_checks", lambda state, st, *a, **k: _step_of(st))
    _span_async(btard_verify, "_collect_passing_over", "collect_passing_over", lambda state, topic, step, *a, **k: {"step": step, "topic": topic})
    for owner in {Transport, p2p.HivemindTransport}:  # the base class's, and the transport's own if it has one
        if "broadcast" in owner.__dict__:
            _span_async(owner, "broadcast", "broadcast", lambda self, topic, step, *a, **k: {"step": step, "topic": topic})
    _span_async(Transport, "collect_broadcasts", "collect", lambda self, topic, step, *a, **k: {"step": step, "topic": topic})
    _span_async(Transport, "fetch_broadcasts", "fetch", lambda self, topic, step, *a, **k: {"step": step, "topic": topic})
    _span_async(p2p.HivemindTransport, "_exchange", "exchange", lambda self, peer, kind, topic, payload: {"topic": topic, "bytes": len(payload), "to": peer[:8]})
    _span_async(p2p.P2P, "call_binary_stream_handler", "stream_open", lambda *a, **k: {})
    _span_sync(SignedEnvelope, "create", "sign")
    _span_sync(SignedEnvelope, "verify", "verify_sig")
    add = BroadcastBoard.add

    def traced_add(self, envelope) -> bool:
        new = add(self, envelope)
        if new and _trace is not None:
            _trace.write("arrive", time.monotonic(), topic=envelope.topic, step=envelope.step, sender=envelope.sender[:8])
        return new

    BroadcastBoard.add = traced_add


def traced_recompute(recompute):
    """`recompute`, each call written down as a `recompute` span."""

    def wrapped(peer: str, step: int):
        start = time.monotonic()
        try:
            return recompute(peer, step)
        finally:
            if _trace is not None:
                _trace.write("recompute", start, time.monotonic(), step=step)

    return wrapped


def mark_step(step: int, start: float, end: float) -> None:
    if _trace is not None:
        _trace.write("step", start, end, step=step)


async def watch_loop() -> None:
    """Write down each wake-up of a short sleep that came LAG_REPORTED or more late: the loop was blocked
    (a synchronous call on it) or the process did not get a core."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(LAG_PERIOD)
        late = time.monotonic() - start - LAG_PERIOD
        if late >= LAG_REPORTED and _trace is not None:
            _trace.write("lag", start + LAG_PERIOD, start + LAG_PERIOD + late)


def close() -> None:
    global _trace
    if _trace is not None:
        _trace.close()
        _trace = None


# --- the table -------------------------------------------------------------------

def _load(directory: Path) -> dict[str, list[dict]]:
    return {p.stem: [json.loads(line) for line in p.read_text().splitlines() if line] for p in sorted(directory.glob("peer*.jsonl"))}


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def table(directory: Path, warmup: int = 1) -> str:
    """The phase table of a traced run: ms per measured step, mean over the peers."""
    peers = _load(directory)
    lines: list[str] = []
    per_peer: dict[str, dict[str, float]] = {}
    steps_all: set[int] = set()
    for name, events in peers.items():
        steps = {e["step"]: (e["t0"], e["t1"]) for e in events if e["kind"] == "step" and e["step"] >= warmup}
        steps_all |= set(steps)
        n = max(1, len(steps))
        rows: dict[str, float] = defaultdict(float)
        windows = list(steps.values())
        for e in events:
            if e["kind"] in ("step", "arrive", "peer"):
                continue
            if e.get("step") is not None and e["step"] < warmup and e["kind"] not in ("lag", "sign", "verify_sig", "exchange"):
                continue
            inside = _overlap(e["t0"], e["t1"], windows)
            key = e["kind"]
            if key in ("broadcast", "collect", "fetch", "collect_passing_over"):
                key = f"{key} {e['topic']}"
            elif key == "exchange":
                key = f"exchange {e['topic']}"
            elif key == "ar_collect":
                key = f"ar_collect {e['what']}"
            rows[key] += inside * 1000 / n
            rows[f"#{key}"] += (1 if inside > 0 else 0) / n
        rows["step"] = sum(b - a for a, b in windows) * 1000 / n
        per_peer[name] = rows
    keys = sorted({k for rows in per_peer.values() for k in rows if not k.startswith("#")}, key=lambda k: -statistics.mean(r.get(k, 0.0) for r in per_peer.values()))
    lines.append("wall ms per measured step inside the step window (sum of span durations; spans overlap and nest), and calls per step")
    lines.append(f"{'span':<40} " + " ".join(f"{name:>14}" for name in per_peer) + f" {'mean':>9}")
    for key in keys:
        values = [per_peer[name].get(key, 0.0) for name in per_peer]
        counts = [per_peer[name].get(f"#{key}", 0.0) for name in per_peer]
        lines.append(f"{key:<40} " + " ".join(f"{v:8.1f} ({c:3.1f})" for v, c in zip(values, counts)) + f" {statistics.mean(values):9.1f}")
    lines.append("")
    lines.append(_rounds(peers, warmup))
    return "\n".join(lines)


def _rounds(peers: dict[str, list[dict]], warmup: int) -> str:
    """Broadcast rounds per topic: from the first sender's broadcast start to the first and the last delivery
    (over every receiver), and from the last sender's start to the last delivery."""
    sends: dict[tuple[str, int], list[float]] = defaultdict(list)
    arrivals: dict[tuple[str, int], list[float]] = defaultdict(list)
    for events in peers.values():
        me = next(e["peer"] for e in events if e["kind"] == "peer")
        for e in events:
            if e["kind"] == "broadcast":
                sends[(e["topic"], e["step"])].append(e["t0"])
            elif e["kind"] == "arrive" and e["sender"] != me:
                arrivals[(e["topic"], e["step"])].append(e["t0"])
    by_topic: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for (topic, step), starts in sends.items():
        if step < warmup:
            continue
        got = [t for t in arrivals[(topic, step)] if t > min(starts) - 1e-9]
        if not got:
            continue
        by_topic[topic].append(((min(got) - min(starts)) * 1000, (max(got) - min(starts)) * 1000, (max(got) - max(starts)) * 1000))
    lines = ["broadcast rounds (ms, median over steps): first send -> first delivery, -> last delivery; last send -> last delivery"]
    for topic, rows in sorted(by_topic.items(), key=lambda item: statistics.median(r[1] for r in item[1])):
        lines.append(f"  {topic:<16} {statistics.median(r[0] for r in rows):8.1f} {statistics.median(r[1] for r in rows):8.1f} "
                     f"{statistics.median(r[2] for r in rows):8.1f}   ({len(rows)} steps)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    print(table(args.directory, args.warmup))


if __name__ == "__main__":
    main()
