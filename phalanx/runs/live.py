"""Records of a run written as it goes: OUT/peers/INDEX.jsonl, the layout `launch` workers write.

`simulate` (every kind) writes them too, so `phalanx watch` follows a simulated
and a launched run alike, on this machine or from a shared directory. A
data-parallel peer's file holds its step records; a pipeline node's holds
{"type": "iteration" | "event", ...} rows; an Aspis coordinator's (index 0)
its iteration records. config.json is written first, so a watcher knows the
run's kind before the first record arrives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO


class LiveLog:
    """Appends rows to OUT/peers/INDEX.jsonl, one flushed line each; a no-op when `out` is None."""

    def __init__(self, out: Path | None, config_json: str) -> None:
        self.dir = None if out is None else out / "peers"
        self.files: dict[int, IO[str]] = {}
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob("*.jsonl"):
            old.unlink()  # a rerun into the same directory starts its records afresh
        (out / "summary.json").unlink(missing_ok=True)  # a watcher must not take an old summary for this run's end
        (out / "config.json").write_text(config_json + "\n")

    def write(self, index: int, row: dict) -> None:
        if self.dir is None:
            return
        sink = self.files.get(index)
        if sink is None:
            sink = self.files[index] = open(self.dir / f"{index}.jsonl", "w")
        sink.write(json.dumps(row, sort_keys=True) + "\n")
        sink.flush()

    def close(self) -> None:
        for sink in self.files.values():
            sink.close()
        self.files.clear()
