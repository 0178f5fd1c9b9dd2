"""The combined run (`secure-gpt-pipeline`, cut down) as real processes over hivemind: 1 data node, 2 stages x 3
relays, GWTF routing, SENTINEL's 3 boundary verifier processes, BTARD in each stage's all-reduce. One relay is
killed mid-iteration, one corrupts its activations, one lies in its stage all-reduce; each defence bans its own
attacker, nobody bans an honest peer, and the run finishes every microbatch.
(It replaces test_hivemind_pipeline.py and test_hivemind_sentinel.py, whose assertions it keeps.)
Where a netns test bed can be built (root, `ip netns`: on CI) every process runs in its own network namespace,
the verifiers on hosts of their own."""

import dataclasses
import json
import os

import pytest

from phalanx.runs.config import override
from phalanx.runs.netns import parse_spec, unavailable_reason
from phalanx.runs.pipeline.config import ChurnConfig
from phalanx.runs.pipeline.launch import launch_hosts, launch_pipeline
from phalanx.runs.pipeline.run import simulate_pipeline
from phalanx.runs.presets import get_preset

pytestmark = pytest.mark.hivemind

STEPS = 12
CORRUPT, LIAR, VICTIM = 0, 1, 4  # relay indices; relay r is in stage 1 + r mod 2
CORRUPT_FROM, LIE_FROM, KILL_AT = 7, 3, 2  # iterations


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_combined_pipeline_over_real_processes_bans_each_attacker_by_its_own_defence(tmp_path):
    # Relay 0 (stage 1) sends zeros from iteration 7: a link attack, SENTINEL's (warm-up: 20 tensors per link and
    # direction, 5 iterations of 4 microbatches). Relay 1 (stage 2) shifts its partition of the stage aggregate from
    # iteration 3: a protocol attack, BTARD's. Relay 4 (stage 1) is killed at the start of iteration 2.
    # btard.timeout 3 s (5 by default): the rounds after the kill wait for the dead replica's commitment and report.
    # sentinel.verdict_timeout 5 s (1 by default, sized for the simulator): on 2 loaded cores a verifier process gets
    # the input sketch it binds a copy to, and the data node its verdict, more than 1 s late; the microbatch is then
    # left out unverified and deferred, and the count below differs (docs/notes/repro/s25/loaded_secure_pipeline.py:
    # this run simulated with every message read late, 0.2 s on average, differs in 5-8 iterations of 12 at 1 s, none
    # at 5 s). The waits end when what they wait for comes: 5 s costs time only when it never comes. The same value is
    # the verifiers' no_copy deadline (a copy that lags a receipt by more is its sender's omission): 5 s there too.
    config = override(get_preset("secure-gpt-pipeline"), [
        "peers=7", f"steps={STEPS}", "pipeline.stages=2", "pipeline.microbatches=4", "pipeline.capacity=2",
        "sentinel.warmup=20", "btard.timeout=3", "allreduce.timeout=3", "sentinel.verdict_timeout=5",
        "attack.name=zeros", f"attack.relays={CORRUPT}", f"attack.start={CORRUPT_FROM}",
        "byzantine.attack=agg_shift", f"byzantine.relays={LIAR}", f"byzantine.start_step={LIE_FROM}",
        f"faults.crash_relay={VICTIM}", f"faults.crash_iteration={KILL_AT}", "faults.crash_at=0.0",
    ])
    out = tmp_path / "launch"
    netns = parse_spec("", launch_hosts(config)) if unavailable_reason() is None else None
    summary = launch_pipeline(config, out, progress=False, netns=netns)
    ids = summary["peer_ids"]
    corrupt, liar, victim = (ids[config.data_nodes + r] for r in (CORRUPT, LIAR, VICTIM))
    stage_of = {peer: config.stage_of(i) for i, peer in enumerate(ids)}
    assert summary["killed"] == victim

    # Every iteration finishes all its microbatches but those a verifier flagged (the verifiers are off the data path:
    # the data node leaves a microbatch with a flagged tensor out of the aggregation), which went through the
    # corrupting relay after its attack began; none is deferred; the killed relay serves none after its iteration.
    rows = _rows(out / "metrics.jsonl")
    mbs = _rows(out / "microbatches.jsonl")
    flagged = [mb for mb in mbs if mb["outcome"] == "flagged"]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["completed"] + sum(mb["it"] == r["step"] for mb in flagged) == 4 for r in rows)
    assert all(r["deferred"] == sum(mb["it"] == r["step"] for mb in flagged) for r in rows)
    assert all(mb["it"] >= CORRUPT_FROM and corrupt in mb["path"] for mb in flagged)
    assert all(victim not in mb["path"] for mb in mbs if mb["it"] > KILL_AT)

    # Both attackers are banned and no live honest peer is, each attacker by its own defence: the corrupting relay
    # by a verifier process (SENTINEL) and never by BTARD, though the stage-2 replicas that received its zeros run
    # BTARD rounds on them; the lying replica by BTARD, recorded by every honest replica of its stage. (The killed
    # relay may be banned too: stage rounds have no App. F departures, so a crash can cost the crashed replica a
    # ban; docs/notes/issue-18.md.)
    bans = _rows(out / "bans.jsonl")
    assert {corrupt, liar} <= {b["peer"] for b in bans} <= {corrupt, liar, victim}
    assert set(summary["banned"]) == {b["peer"] for b in bans}
    against_corrupt = [b for b in bans if b["peer"] == corrupt]
    assert all(b["reason"] == "sentinel" and b["step"] >= CORRUPT_FROM for b in against_corrupt)
    assert {b["by"] for b in against_corrupt} <= set(summary["verifier_ids"].values())
    against_liar = [b for b in bans if b["peer"] == liar]
    assert all(b["reason"].startswith("btard:") and b["step"] >= LIE_FROM for b in against_liar)
    honest = [p for p in ids if p not in (corrupt, liar, victim)]
    assert {b["by"] for b in against_liar} >= {p for p in honest if stage_of[p] == stage_of[liar]}
    attacks = _rows(out / "attacks.jsonl")
    assert any(a["tampered"] for a in attacks) and {a["peer"] for a in attacks} == {corrupt}

    # Every honest process ends routing around both attackers (BTARD's ban reaches the data node and the other
    # stage through a majority of the liar's stage), and no microbatch goes through either after its ban.
    assert all({corrupt, liar} <= set(summary["excluded"][p]) for p in honest)
    assert not any(set(summary["excluded"][p]) & set(honest) for p in honest)
    # (a verifier's ban takes effect at once, a stage round's at the end of the next iteration's round)
    for peer, lag in ((corrupt, 0), (liar, 1)):
        after = [mb for mb in mbs if mb["it"] > max(b["step"] for b in bans if b["peer"] == peer) + lag]
        assert after and all(peer not in mb["path"] for mb in after)

    # The honest replicas of each stage end identical.
    digests = {}
    for peer in honest:
        stage, version, digest = summary["replicas"][peer]
        assert version == STEPS
        digests.setdefault(stage, set()).add(digest)
    assert sorted(digests) == [0, 1, 2] and all(len(d) == 1 for d in digests.values())

    # Same seed, same public batches: no microbatch was lost, so the loss follows the simulated run (the first
    # iterations, the kill's and the first lie's among them: the simulated run has no kill).
    early = KILL_AT + 2
    simulated = simulate_pipeline(dataclasses.replace(config, steps=early, faults=ChurnConfig()), progress=False)
    assert [r["loss"] for r in rows[:early]] == pytest.approx([r["loss"] for r in simulated["metrics"]], rel=0.01)

    if netns is not None:  # node i on host i, the verifiers of links 0-2 on hosts 7-9, each listening on its address
        assert (out / "peers" / "0.addr").read_text().startswith("/ip4/10.77.0.1/tcp/")
        assert {name: h["address"] for name, h in summary["netns"].items()} == {
            **{str(i): f"10.77.0.{i + 1}" for i in range(7)}, **{f"v{link}": f"10.77.0.{8 + link}" for link in range(3)}}
    assert len(summary["process_groups"]) == 7 + 3
    for pgid in summary["process_groups"]:  # every worker and verifier, its DHT child and its p2pd are gone
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
