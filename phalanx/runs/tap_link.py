"""A user-space link with delay, jitter and loss, for kernels without `sch_netem`.

The link is a pair of TAP devices, one in a host's namespace and one in the
test bed's hub, and this process between them: every Ethernet frame read from
one device is dropped with probability loss, or written to the other after
delay + uniform(-jitter, jitter) ms. Frames keep their order (a frame never
overtakes the one before it). Both devices are created by this process without
TUNSETPERSIST, so they vanish with it: the link cannot outlive its process.

    python -m phalanx.runs.tap_link HOST_NS HOST_DEV HUB_NS HUB_DEV --delay MS --jitter MS --loss PCT

prints "ready" once both devices exist, then forwards until it is killed (it
also dies with its parent).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import queue
import random
import signal
import struct
import threading
import time

from .netns import entered
from .processes import set_parent_death_signal

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536
LINK_NICE = -5  # a link does not wait behind the peers' training for the CPU (root may raise priority)


def open_tap(name: str) -> int:
    """Create TAP device `name` in the calling thread's namespace; return its fd (the device lives while it is open)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def forward(source: int, sink: int, delay: float, jitter: float, loss: float, rng: random.Random) -> None:
    """Move frames from `source` to `sink` forever: drop each with probability `loss`, delay the rest (seconds)."""
    pending: queue.SimpleQueue = queue.SimpleQueue()

    def write() -> None:
        while True:
            release, frame = pending.get()
            wait = release - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                os.write(sink, frame)
            except OSError:
                pass  # the device is down (the test bed is being torn down)

    threading.Thread(target=write, daemon=True).start()
    last = 0.0
    while True:
        frame = os.read(source, MAX_FRAME)
        if rng.random() < loss:
            continue
        last = max(last, time.monotonic() + delay + rng.uniform(-jitter, jitter))
        pending.put((last, frame))


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host_ns")
    parser.add_argument("host_dev")
    parser.add_argument("hub_ns")
    parser.add_argument("hub_dev")
    parser.add_argument("--delay", type=float, default=0.0, help="ms, each direction")
    parser.add_argument("--jitter", type=float, default=0.0, help="ms, each direction")
    parser.add_argument("--loss", type=float, default=0.0, help="percent, each direction")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    set_parent_death_signal(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run; the link stays up while it shuts down
    try:
        os.setpriority(os.PRIO_PROCESS, 0, LINK_NICE)  # before the threads start: they inherit it
    except PermissionError:
        pass
    with entered(args.host_ns):
        host = open_tap(args.host_dev)
    with entered(args.hub_ns):
        hub = open_tap(args.hub_dev)
    delay, jitter, loss = args.delay / 1000, args.jitter / 1000, args.loss / 100
    for source, sink, seed in ((host, hub, 2 * args.seed), (hub, host, 2 * args.seed + 1)):
        rng = random.Random(seed)
        threading.Thread(target=forward, args=(source, sink, delay, jitter, loss, rng), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()  # until SIGTERM or SIGKILL ends the process


if __name__ == "__main__":
    _main()
