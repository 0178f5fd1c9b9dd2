"""Transport: one interface (base.Transport), two implementations.

- base: the interface protocols are written against
- broadcast: the board of signed broadcasts with equivocation proofs (shared)
- sim: the deterministic in-process simulator (the network, its transports)
- virtual_time: the event loop whose clock jumps to the next timer, that the simulator runs on
- p2p: real OS processes over hivemind's libp2p daemon and DHT
"""

from .base import BROADCAST_TOPIC, Transport
from .broadcast import BroadcastBoard

__all__ = ["BROADCAST_TOPIC", "BroadcastBoard", "Transport"]
