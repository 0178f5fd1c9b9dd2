"""RP s25 finding 3 (pre-existing; verifier.py, helper hS's file; relevant to 24a701d): `sentinel.verdict_timeout`
also sets the `no_copy` deadline. A verifier that has a relay's receipt and no copy of the tensor within
verdict_timeout flags the SENDER (strikes ban it). An honest relay whose link to its boundary verifier is slower
than its link to the next relay (another host, another route) sends the copy first, yet the copy arrives after the
receipt by more than verdict_timeout. Every copy then queues behind the one before on that link.
Scenario: 1 data node + 3 stages x 2 relays, SENTINEL boundary off_path (the secure preset's placement),
activations padded to 5 MB (the all cell's padding), no faults. The first stage-1 relay's link to the link-1 verifier
runs at BW bytes/s (default 2.5e6: 2 s per copy). Everything else is at the default 125 MB/s.
Run: cd <checkout> && PYTHONPATH=$PWD nice -n 10 /work/main/.venv/bin/python <this file> [BW] [verdict_timeout]
"""
import sys
from dataclasses import replace

sys.path.insert(0, "tests")
from test_pipeline import _crash_config  # noqa: E402

from phalanx.runtime.pipeline.verifier import VerifierConfig  # noqa: E402
from phalanx.runs.dp.swarm import peer_identity  # noqa: E402
from phalanx.runs.pipeline.config import ChurnConfig  # noqa: E402
from phalanx.runs.pipeline.run import simulate_pipeline, verifier_ids  # noqa: E402
from phalanx.transport.sim import LinkProfile  # noqa: E402

BW = float(sys.argv[1]) if len(sys.argv) > 1 else 2.5e6
VT = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
config = _crash_config("gwtf")
config = replace(config, faults=ChurnConfig(), steps=3,
                 pipeline=replace(config.pipeline, activation_bytes=5_000_000),
                 sentinel=VerifierConfig(enabled=True, placement="boundary", hop="off_path", verdict_timeout=VT))
relay = next(peer_identity(config.seed, i).peer_id for i in range(config.peers) if config.stage_of(i) == 1)
verifier = verifier_ids(config)[1]


def slow_link(network, directory):
    network.set_link(relay, verifier, LinkProfile(latency=0.005, bandwidth=BW))


s = simulate_pipeline(config, progress=False, adversary=slow_link)
print(f"honest stage-1 relay {relay[:8]} -> link-1 verifier {verifier[:8]} at {BW:.3g} B/s; verdict_timeout {VT}")
for b in s["bans"]:
    print("ban:", {k: (v[:8] if isinstance(v, str) and len(v) > 40 else v) for k, v in b.items()})
for v in s.get("verdicts", [])[:0]:
    print(v)
print("banned:", [p[:8] for p in s["banned"]])
print("outcomes per iteration:", [[mb["outcome"] for mb in s["microbatches"] if mb["it"] == it] for it in range(config.steps)])
if relay in s["banned"]:
    print("FAIL: an honest relay is banned for copies that were sent first and arrived late")
