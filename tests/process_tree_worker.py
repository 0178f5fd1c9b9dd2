"""A stand-in for a hivemind worker's process tree, for tests/test_processes.py.

usage: process_tree_worker.py MARKER READY_FILE [--die-with-parent] [--spawn-worker]

It guards itself like a real worker, then builds the same tree hivemind
builds: a forked daemon child (the DHT process) that starts a grandchild with
subprocess (p2pd). When the tree stands it writes READY_FILE and sleeps.
With --spawn-worker it is instead a launcher: it starts one such worker with
--die-with-parent, waits for its READY_FILE, then writes its own and sleeps.
"""
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx.runs.processes import guard_worker  # noqa: E402


def dht_child(ready: Path) -> None:
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ready.write_text(str(grandchild.pid))
    time.sleep(600)


def main() -> None:
    marker, ready = sys.argv[1], Path(sys.argv[2])
    if "--spawn-worker" in sys.argv:
        inner = ready.with_suffix(".inner")
        subprocess.Popen([sys.executable, __file__, marker + "/w", str(inner), "--die-with-parent"])
        while not inner.exists():
            time.sleep(0.05)
        ready.write_text("launcher")
        time.sleep(600)
        return
    guard_worker(marker, die_with_parent="--die-with-parent" in sys.argv)
    child_ready = ready.with_suffix(".child")
    child = mp.get_context("fork").Process(target=dht_child, args=(child_ready,), daemon=True)
    child.start()
    while not child_ready.exists():
        time.sleep(0.05)
    ready.write_text("worker")
    time.sleep(600)


if __name__ == "__main__":
    main()
