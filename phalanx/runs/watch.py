"""`phalanx watch RUN_DIR`: a local page that follows a run's files while it runs.

It reads only files: config.json, the per-peer records under peers/ (written
as the run goes by `simulate` and by `launch` workers alike, see live.py), and
summary.json / metrics.jsonl / bans.jsonl when the run has them. So it works
the same for a simulated run, a launched one, and a run on another machine
whose directory is shared. `WatchState` folds rows into the series the page
draws (no I/O); `RunFollower` reads the new complete lines of each file;
`make_app` serves the page and /api/state (aiohttp, no JavaScript build step).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict
from pathlib import Path

from ..core.errors import ConfigError
from .config import kind_name
from .watch_page import PAGE

CRASH_GRACE = 2  # steps a data-parallel peer may lag the front of the run before it is marked crashed


class WatchState:
    """The live view of one run: feed rows with `add`, read the page's data with `snapshot`."""

    def __init__(self) -> None:
        self.config: dict = {}
        self.summary: dict | None = None
        self.records = 0
        self.ids: dict[str, int] = {}  # peer id -> index, learnt from the per-peer files
        # data-parallel and Aspis
        self.loss: dict[int, list[float]] = defaultdict(list)
        self.test: dict[str, dict[int, list[float]]] = {"test_loss": defaultdict(list), "test_accuracy": defaultdict(list)}
        self.present: dict[int, set[int]] = defaultdict(set)
        self.last_step: dict[int, int] = {}
        self.events: list[dict] = []
        self.banned: set[str] = set()
        self.admission: dict[int, tuple[int, int, int, int]] = {}  # step -> (source, trusted, untrusted, queued)
        # pipeline
        self.outcomes: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.busy: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.completed: dict[int, list[tuple[float, int]]] = defaultdict(list)
        self.links: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # link -> [checked, flagged]
        self.link_flags: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))

    @property
    def kind(self) -> str:
        name = kind_name(self.config)
        return "dp" if name == "data-parallel" else name

    def add(self, source: int, row: dict) -> None:
        """One row of peers/SOURCE.jsonl."""
        self.records += 1
        if isinstance(row.get("peer"), str):
            self.ids.setdefault(row["peer"], source)
        if "type" in row:
            self._pipeline(row)
            return
        step = int(row["step"])
        if row.get("loss") is not None:
            self.loss[step].append(float(row["loss"]))
        for key, values in self.test.items():
            if key in row:
                values[step].append(float(row[key]))
        if self.kind == "aspis":
            self._aspis(step, row)
            return
        previous = self.last_step.get(source)
        if previous is None and step > 0:
            self.events.append({"step": step, "kind": "join", "peer": source, "reason": "joined"})
        elif previous is not None and step > previous + 1:
            self.events.append({"step": previous + 1, "kind": "crash", "peer": source, "reason": "left"})
            self.events.append({"step": step, "kind": "join", "peer": source, "reason": "came back"})
        self.last_step[source] = step
        self.present[step].add(source)
        for ban in row.get("bans", []):
            if ban["peer"] not in self.banned:
                self.banned.add(ban["peer"])
                self.events.append({"step": ban["step"], "kind": "ban", "peer": ban["peer"], "reason": ban["reason"]})
        status = row.get("admission")
        if status is not None and (step not in self.admission or source < self.admission[step][0]):
            self.admission[step] = (source, len(status["trusted"]), len(status["untrusted"]), len(status["queued"]))

    def _aspis(self, step: int, row: dict) -> None:
        answering = row.get("files_used", 0)
        self.present[step] = set(range(answering))
        for worker in row.get("flagged", []):
            self.events.append({"step": step, "kind": "ban", "peer": worker, "reason": "aspis-flagged"})

    def _pipeline(self, row: dict) -> None:
        if row["type"] == "iteration":
            it = int(row["it"])
            if row.get("loss") is not None:
                self.completed[it].append((float(row["loss"]), int(row["completed"])))
            for mb in row.get("microbatches", []):
                self.outcomes[mb["outcome"]][it] += 1
            return
        kind = row.get("kind")
        if kind in ("fwd", "bwd"):
            self.busy[int(row["stage"])][int(row["it"])] += float(row["t1"]) - float(row["t0"])
            self.present[int(row["it"])].add(row["peer"])  # nodes that computed in the iteration
        elif kind == "verdict":
            link = int(row["link"])
            self.links[link][0] += 1
            if row["flagged"]:
                self.links[link][1] += 1
                self.link_flags[link][int(row["it"])] += 1
        elif kind == "ban" and row["peer"] not in self.banned:
            self.banned.add(row["peer"])
            self.events.append({"step": int(row["step"]), "kind": "ban", "peer": row["peer"], "reason": row.get("reason", "?")})

    def add_metrics(self, rows: list[dict]) -> None:
        """A finished run's metrics.jsonl, for runs without per-peer files (a `phalanx peer` run, an old run)."""
        for row in rows:
            step = int(row["step"])
            if row.get("loss") is not None:
                self.loss[step] = [float(row["loss"])]
            for key, values in self.test.items():
                if key in row:
                    values[step] = [float(row[key])]
            if "peers" in row:
                self.present[step] = set(range(int(row["peers"])))

    def snapshot(self) -> dict:
        label = {peer: index for peer, index in self.ids.items()}
        events = [dict(e, peer=label.get(e["peer"], e["peer"]) if isinstance(e["peer"], str) else e["peer"]) for e in self.events]
        front = max(self.present, default=-1)
        finished = self.summary is not None
        if self.kind == "dp":
            for source, last in sorted(self.last_step.items()):
                ids = [p for p, i in self.ids.items() if i == source]
                gone = (finished and last < front) or (not finished and last < front - CRASH_GRACE)
                if gone and not (ids and ids[0] in self.banned):
                    events.append({"step": last + 1, "kind": "crash", "peer": source, "reason": "crashed"})
        if self.kind == "pipeline":
            loss = {it: sum(l * c for l, c in v) / max(1, sum(c for _, c in v)) for it, v in self.completed.items()}
        else:
            loss = {s: sum(v) / len(v) for s, v in self.loss.items()}
        return {
            "kind": self.kind,
            "preset": self.config.get("preset", "?"),
            "planned_steps": self.config.get("steps"),
            "finished": finished,
            "records": self.records,
            "steps_seen": max([*loss, *self.present, -1]) + 1,
            "peers_seen": len(self.last_step) or len(self.ids),
            "banned": len(self.banned),
            "loss": _series(loss),
            "test_loss": _series({s: sum(v) / len(v) for s, v in self.test["test_loss"].items()}),
            "test_accuracy": _series({s: sum(v) / len(v) for s, v in self.test["test_accuracy"].items()}),
            "peers_per_step": _series({s: len(p) for s, p in self.present.items()}),
            "events": sorted(events, key=lambda e: (e["step"], e["kind"])),
            "admission": {name: _series({s: v[k] for s, v in self.admission.items()})
                          for k, name in ((1, "trusted"), (2, "untrusted"), (3, "queued"))},
            "occupancy": {str(stage): _series(per_it) for stage, per_it in sorted(self.busy.items())},
            "outcomes": {name: _series(per_it) for name, per_it in sorted(self.outcomes.items())},
            "links": [{"link": link, "checked": c, "flagged": f} for link, (c, f) in sorted(self.links.items())],
            "link_flags": {str(link): _series(per_it) for link, per_it in sorted(self.link_flags.items())},
        }


def _series(values: dict[int, float]) -> list[list[float]]:
    return [[step, values[step]] for step in sorted(values)]


class RunFollower:
    """Reads what is new in a run directory into a WatchState (complete lines only: a writer may be mid-line)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.state = WatchState()
        self.offsets: dict[Path, int] = {}
        self.config_mtime = 0.0

    def poll(self) -> WatchState:
        config = self.run_dir / "config.json"
        if config.exists() and config.stat().st_mtime != self.config_mtime:
            if self.config_mtime:  # the directory holds a new run: start over
                self.state, self.offsets = WatchState(), {}
            self.config_mtime = config.stat().st_mtime
            self.state.config = _json(config) or {}
        peer_files = sorted((self.run_dir / "peers").glob("*.jsonl"), key=lambda p: _index(p))
        for path in peer_files:
            for row in self._new_rows(path):
                self.state.add(_index(path), row)
        summary = self.run_dir / "summary.json"
        if self.state.summary is None and summary.exists() and summary.stat().st_mtime >= self.config_mtime:  # not a rerun's old one
            self.state.summary = _json(summary)
            if self.state.summary is not None and not peer_files:
                self.state.add_metrics(list(self._new_rows(self.run_dir / "metrics.jsonl")))
        return self.state

    def _new_rows(self, path: Path):
        if not path.exists():
            return
        start = self.offsets.get(path, 0)
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offsets[path] = start + end
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed writer
            if isinstance(row, dict):
                yield row


def _index(path: Path) -> int:
    try:
        return int(path.stem)
    except ValueError:
        return 1 << 30


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # being written: read it at the next poll
    return value if isinstance(value, dict) else None


def make_app(run_dir: Path):
    """The aiohttp application: / (the page) and /api/state (the snapshot, after reading what is new)."""
    from aiohttp import web

    follower = RunFollower(run_dir)
    lock = asyncio.Lock()

    async def page(_request) -> web.Response:
        return web.Response(text=PAGE.replace("__RUN_DIR__", str(run_dir)), content_type="text/html")

    async def state(_request) -> web.Response:
        async with lock:
            snapshot = follower.poll().snapshot()
        return web.json_response(snapshot)

    app = web.Application()
    app.add_routes([web.get("/", page), web.get("/api/state", state)])
    return app


def _check_aiohttp() -> None:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ConfigError("phalanx watch needs aiohttp: pip install -e '.[watch]'") from None


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve the page until Ctrl-C."""
    _check_aiohttp()
    from aiohttp import web

    print(f"watching {run_dir} at http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    web.run_app(make_app(run_dir), host=host, port=port, print=None, shutdown_timeout=1.0)


class BackgroundWatch:
    """The page served from a thread of this process (simulate --watch, launch --watch, tests)."""

    def __init__(self, run_dir: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        _check_aiohttp()
        self.run_dir, self.host = run_dir, host
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = port
        self.thread = threading.Thread(target=self._run, name="phalanx-watch", daemon=True)
        self.thread.start()
        self.ready.wait()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(make_app(self.run_dir))
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, self.host, self.port)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
