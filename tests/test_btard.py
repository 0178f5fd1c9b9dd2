"""BTARD: reducer config, secure round, verifications, bans, attacks, admission."""

import dataclasses
import json
import math

import pytest
import torch

from phalanx.algorithms.btard.admission import (
    Admission,
    AdmissionConfig,
    Admitted,
    Banned,
    Queued,
    Trusted,
)
from phalanx.algorithms.btard.bans import BanLedger
from phalanx.algorithms.btard.checks import (
    ACCUSE,
    ELIMINATE,
    Claim,
    Verdict,
    gradient_matches,
    norm_matches,
    passed_over,
    project,
    resolve,
    s_matches,
    sum_holds,
    sum_tolerance,
    tensor_hash,
)
from phalanx.algorithms.robust.attacks import Attack
from phalanx.algorithms.robust.reducers import make_reducer
from phalanx.benchmarks.btard_redteam import RedTeamConfig, Update, bounded_effect, run_trial
from phalanx.core.errors import ConfigError
from phalanx.core.serialization import decode, encode
from phalanx.runs.config import override
from phalanx.runs.dp.simulate import simulate
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runs.presets import get_preset
from phalanx.runtime.dp.peer import DataParallelPeer, TrainConfig
from phalanx.runtime.rounds import btard_verify
from phalanx.runtime.rounds.btard import AGGREGATE_ANSWERS
from phalanx.runtime.rounds.btard_judge import _missing_meta
from phalanx.runtime.rounds.btard_state import BTARDConfig, StepState
from phalanx.runtime.rounds.butterfly import AllReduceConfig
from phalanx.training.task import make_task
from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation


def test_reducer_config_names_rules_and_rejects_unknown():
    config = override(get_preset("digits-dp"), ["allreduce.reducer=centered_clip", "allreduce.tau=10"])
    reduce = config.allreduce.build_reducer()
    xs = torch.tensor([[0.0, 0.0], [1.0, 0.0], [100.0, 0.0]])
    assert reduce(xs)[0].item() == pytest.approx(make_reducer("centered_clip", tau=10.0)(xs)[0].item())
    assert reduce(xs)[0].item() < 20  # clipped, unlike the mean (33.7)
    assert make_reducer("centered_clip", tau=float("inf"))(xs)[0].item() == pytest.approx(101 / 3)
    assert make_reducer("trimmed_mean", f=5)(xs)[0].item() == 1.0  # trim clamped to what 3 rows allow
    with pytest.raises(ConfigError, match="allreduce.reducer"):
        override(get_preset("digits-dp"), ["allreduce.reducer=average"])
    with pytest.raises(ConfigError, match="allreduce.tau"):
        AllReduceConfig(tau=0.0)


def test_attack_params_are_a_mapping_checked_against_the_attack():
    config = override(get_preset("btard-digits"), ["byzantine.attack=agg_shift", "byzantine.params.scale=0.5", "byzantine.params.consistent=false"])
    assert config.byzantine.params == {"scale": 0.5, "consistent": False}
    with pytest.raises(ConfigError, match="byzantine.params"):
        override(get_preset("btard-digits"), ["byzantine.attack=sign_flip", "byzantine.params.bogus=1"])
    with pytest.raises(ConfigError, match="btard.enabled"):
        override(get_preset("digits-dp"), ["byzantine.count=1", "byzantine.attack=slander"])
    with pytest.raises(ConfigError, match="cannot be verified"):
        override(get_preset("btard-digits"), ["allreduce.reducer=krum"])
    with pytest.raises(ConfigError, match="mapping"):
        override(get_preset("btard-digits"), ["byzantine.params=3"])


@dataclasses.dataclass(kw_only=True)
class Truncate(Attack):
    """A peer that sends a gradient 7 entries short, so its last part has the wrong length."""

    def forge(self, view):
        return view.own_gradient[:-7]


def test_short_vector_from_the_last_partition_owner_is_evidence_not_a_crash():
    identities = [peer_identity(0, i) for i in range(4)]
    last = max(range(4), key=lambda i: identities[i].peer_id)
    task = make_task("digits-mlp")
    peers = []

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        for i, identity in enumerate(identities):
            attack = Truncate() if i == last else None
            peers.append(DataParallelPeer(network.add_peer(identity), task, TrainConfig(), 0, attack=attack))
        tasks = [network.spawn(identities[i].peer_id, lambda i=i: peers[i].run(3)) for i in range(4)]
        for t in tasks:
            await t

    run_simulation(main)
    assert all(p.step == 3 for p in peers)  # this stack of unequal rows used to crash the run
    assert all(torch.isfinite(p).all() for peer in peers for p in peer.model.parameters())
    # The short part is the villain's own partition: nobody else receives it, so there is no evidence.
    assert [e for peer in peers for e in peer.transport.evidence] == []


def test_a_member_that_pulls_one_aggregate_again_and_again_gets_it_at_most_twice_and_a_non_member_never():
    # bt.aggregate is a small request for a partition-sized answer: each (requester, step, owner) is
    # answered AGGREGATE_ANSWERS times, then the requester gets nothing (and nobody crashes).
    identities = [peer_identity(0, i) for i in range(4)]
    ids = sorted(i.peer_id for i in identities)
    task = make_task("digits-mlp")
    peers, answers = [], []

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        for identity in identities:
            btard = BTARDConfig(enabled=True, timeout=1.0)
            peers.append(DataParallelPeer(network.add_peer(identity), task, TrainConfig(), 0, allreduce=AllReduceConfig(reducer="centered_clip"), btard=btard))
        tasks = [network.spawn(identities[i].peer_id, lambda i=i: peers[i].run(1)) for i in range(4)]
        for t in tasks:
            await t
        server = next(p for p in peers if p.transport.peer_id == ids[0])
        puller = next(p for p in peers if p.transport.peer_id == ids[1])
        query = encode({"step": 0, "g": server.allreduce._group[0], "owner": ids[2]})
        for _ in range(AGGREGATE_ANSWERS + 3):
            answer = await puller.transport.request(ids[0], "bt.aggregate", query, 1.0)
            answers.append(decode(answer, ids[0])["t"])
        other = next(p for p in peers if p.transport.peer_id == ids[3])  # another requester is not limited by it
        answers.append(decode(await other.transport.request(ids[0], "bt.aggregate", query, 1.0), ids[0])["t"])
        outsider = network.add_peer(peer_identity(0, 9))  # not in step 0's group (a Sybil would be fresh too): never served
        answers.append(decode(await outsider.request(ids[0], "bt.aggregate", query, 1.0), ids[0])["t"])

    run_simulation(main)
    assert [a is not None for a in answers] == [True] * AGGREGATE_ANSWERS + [False] * 3 + [True, False]
    assert [e for peer in peers for e in peer.transport.evidence] == []


# --- verification math ---------------------------------------------------------


def _partition(gen, k=8, m=64):
    """k honest-looking float32 parts (one an outlier) and their CenteredClip aggregate."""
    xs = (torch.randn(m, generator=gen) + 0.3 * torch.randn(k, m, generator=gen)).float()
    xs[0] += 20.0 * torch.randn(m, generator=gen)
    return xs, make_reducer("centered_clip", tau=1.0, eps=1e-6)(xs)


def test_projection_matches_direct_recomputation():
    gen = torch.Generator().manual_seed(1)
    xs, a = _partition(gen)
    z = torch.randn(a.shape, generator=gen)
    for x in xs:
        diff = [float(u) - float(v) for u, v in zip(x, a)]
        norm = math.sqrt(math.fsum(d * d for d in diff))
        weight = min(1.0, 1.0 / norm)
        s = math.fsum(float(zk) * d * weight for zk, d in zip(z, diff))
        p = project(x, a, z, 1.0)
        assert p.norm == pytest.approx(norm, rel=1e-12)
        assert p.s == pytest.approx(s, rel=1e-9, abs=1e-12)
        assert p.delta_norm == pytest.approx(min(norm, 1.0), rel=1e-12)


def test_honest_values_never_trip_and_lies_of_one_in_a_thousand_do():
    gen = torch.Generator().manual_seed(0)
    sum_lies_caught = 0
    for trial in range(1000):  # 250 partitions (CenteredClip is the slow part), 4 directions each
        if trial % 4 == 0:
            xs, a = _partition(gen)
        z = torch.randn(a.shape, generator=gen)
        z_norm = float(z.norm())
        projections = [project(x, a, z, 1.0) for x in xs]
        # the reporter computes the same quantities in another summation order
        flipped = [project(x.flip(0), a.flip(0), z.flip(0), 1.0) for x in xs]
        for p, q in zip(projections, flipped):
            assert norm_matches(q.norm, p.norm)  # V1, honest
            assert s_matches(q.s, p, z_norm)  # V2 owner check, honest
            assert not norm_matches(q.norm * (1 + 1e-3), p.norm)  # V1, lie
            assert not s_matches(q.s + 1e-3 * z_norm * p.delta_norm, p, z_norm)  # V2, lie
        tolerance = sum_tolerance(len(xs), 1e-6, float(a.norm()), z_norm, [p.delta_norm for p in projections])
        assert sum_holds([q.s for q in flipped], tolerance)  # V2 sum, honest owner
        shift = torch.randn(a.shape, generator=gen)
        shifted = a + 1e-3 * float(a.norm()) * shift / shift.norm()
        lied = [project(x, shifted, z, 1.0) for x in xs]
        sum_lies_caught += not sum_holds([p.s for p in lied], sum_tolerance(len(xs), 1e-6, float(shifted.norm()), z_norm, [p.delta_norm for p in lied]))
        g = xs.reshape(-1)
        assert gradient_matches(g.clone(), g)
        assert not gradient_matches(g + 1e-3 * float(g.norm()) * shift.repeat(len(xs)) / (shift.norm() * math.sqrt(len(xs))), g)
    # The sum sees a shifted aggregate through one random projection: it misses it only when
    # |N(0,1)| falls under tolerance / signal (about 0.5% here); validators catch the rest.
    assert sum_lies_caught >= 980


def test_resolve_orders_claims_and_bans_eliminators_and_slanderers():
    ledger = BanLedger()
    claims = [
        Claim(ELIMINATE, "h1", "b1", "part_hash"),
        Claim(ELIMINATE, "h2", "b1", "part_hash"),  # ignored: b1 is banned by then
        Claim(ACCUSE, "b2", "h3", "gradient"),  # slander
        Claim(ACCUSE, "h4", "b3", "gradient"),  # upheld, with b2's cover (b2 is already banned)
        Claim(ACCUSE, "h4", "b4", "gradient"),
        Claim(ACCUSE, "h6", "h7", "gradient"),  # this peer cannot weigh it (no weights of that step): nobody pays
    ]
    verdicts = {"h3": Verdict(False), "b3": Verdict(True, ("b2",)), "b4": Verdict(True, ("b5",)), "h7": Verdict(False, judged=False)}
    applied = resolve(ledger, 7, claims, lambda c: verdicts[c.target])
    assert set(ledger.banned) == {"b1", "h1", "b2", "b3", "b4", "b5"}  # neither h6 nor h7
    reasons = {r.peer: (r.reason, r.accuser) for r in applied}
    assert reasons["b2"] == ("slander:gradient", "b2")
    assert reasons["b1"] == ("eliminated:part_hash", "h1") and reasons["h1"] == ("eliminator", "h1")
    assert reasons["b5"] == ("covered:gradient", "h4")
    dry = BanLedger()
    assert len(resolve(dry, 7, claims, lambda c: verdicts[c.target], apply=False)) == len(applied)
    assert dry.banned == []


# --- whole-swarm scenarios -------------------------------------------------------


def _btard_run(tmp_path, attack, *extra, peers=5, steps=6, count=1):
    config = override(
        get_preset("btard-digits"),
        [f"peers={peers}", f"steps={steps}", f"byzantine.count={count}", f"byzantine.attack={attack}",
         "byzantine.start_step=0", "btard.timeout=1.0", *extra],
    )
    summary = simulate(config, tmp_path, progress=False)
    honest = [p for p in summary["peer_ids"] if p not in summary["byzantine"]]
    views = {p: set(summary["banned_by_peer"][p]) for p in honest}
    return summary, honest, views


def test_eliminate_bans_the_forger_and_exactly_one_honest_owner(tmp_path):
    summary, honest, views = _btard_run(tmp_path, "wrong_hash", steps=3)
    expected = {summary["byzantine"][0], min(honest)}  # canonical order: the lowest-id accuser goes with it
    assert all(view == expected for view in views.values())
    rows = [json.loads(line) for line in (tmp_path / "bans.jsonl").read_text().splitlines()]
    assert {(r["peer"], r["reason"]) for r in rows} == {(summary["byzantine"][0], "eliminated:part_hash"), (min(honest), "eliminator")}
    assert all(r["step"] == 0 for r in rows)


def test_accuse_bans_a_sign_flipper_found_by_a_validator_and_nobody_else(tmp_path):
    summary, honest, views = _btard_run(tmp_path, "sign_flip", "btard.validators=2", steps=8)
    assert all(view == set(summary["byzantine"]) for view in views.values())
    rows = [json.loads(line) for line in (tmp_path / "bans.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rows] == ["gradient"] and rows[0]["accuser"] in honest


def test_slanderer_is_banned_instead_of_its_victim(tmp_path):
    summary, honest, views = _btard_run(tmp_path, "slander", steps=3)
    assert all(view == set(summary["byzantine"]) for view in views.values())
    rows = [json.loads(line) for line in (tmp_path / "bans.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["step"]) for r in rows] == [("slander:gradient", 0)]


@pytest.mark.parametrize(
    "attack, reason, extra",
    [
        ("agg_shift", "v2_sum", []),
        ("agg_shift", "averaging", ["btard.delta_max=1e-9"]),  # V3 fires everywhere: honest owners pass CHECKAVERAGING
        ("lie_norms", "v1_norm", []),
        ("lie_inner_products", "v2_sum", []),  # its lie also breaks its own partition's sum, claimed first (accuser "")
        ("constant", "bad_aggregate", ["byzantine.params.value=nan"]),
    ],
)
def test_aggregation_and_metadata_lies_and_nan_parts_are_banned_at_once(tmp_path, attack, reason, extra):
    summary, honest, views = _btard_run(tmp_path, attack, *extra, peers=4, steps=2)
    assert all(view == set(summary["byzantine"]) for view in views.values())
    rows = [json.loads(line) for line in (tmp_path / "bans.jsonl").read_text().splitlines()]
    assert rows[0]["reason"] == reason and rows[0]["step"] == 0


def test_background_verification_bans_what_inline_verification_bans(tmp_path):
    # Step k is verified while step k + 1 runs and resolved at the end of step k + 1's all-reduce;
    # the verdicts (who, why, at which step's claims) equal those of verifying before the SGD step.
    _, honest, background = _btard_run(tmp_path / "bg", "sign_flip", "btard.validators=2", steps=8, peers=6, count=2)
    _, _, inline = _btard_run(tmp_path / "inline", "sign_flip", "btard.validators=2", "btard.background=false", steps=8, peers=6, count=2)
    rows = {mode: [json.loads(line) for line in (tmp_path / mode / "bans.jsonl").read_text().splitlines()] for mode in ("bg", "inline")}
    assert rows["bg"] and rows["bg"] == rows["inline"]
    assert all(background[p] == inline[p] for p in honest)
    metrics = [json.loads(line) for line in (tmp_path / "bg" / "metrics.jsonl").read_text().splitlines()]
    first = min(r["step"] for r in rows["bg"])
    # a peer caught at step k still contributes to step k + 1, and is gone from step k + 2
    assert max(r["peers"] for r in metrics if r["step"] == first + 1) > min(r["peers"] for r in metrics if r["step"] == first + 2)


def test_same_seed_same_bans_and_metrics_with_attacks_on(tmp_path):
    _btard_run(tmp_path / "a", "sign_flip", "btard.validators=2", steps=5)
    _btard_run(tmp_path / "b", "sign_flip", "btard.validators=2", steps=5)
    for name in ("metrics.jsonl", "bans.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


# --- Sybil-resistant admission (App. F) -------------------------------------------


def test_admission_limits_untrusted_peers_and_trusts_after_t_approvals():
    admission = Admission([f"t{i}" for i in range(5)], AdmissionConfig(approvals=3))
    assert admission.slots == 2
    assert admission.join("a") == [Admitted("a")]
    assert admission.join("b") == [Admitted("b")]
    assert admission.join("c") == [Queued("c", 0)]
    assert admission.join("d") == [Queued("d", 1)]
    assert "a" not in admission.aggregated() and "a" in admission.committing()
    assert admission.approved("a") == [] and admission.approved("a") == []
    assert admission.approved("a") == [Trusted("a"), Admitted("c"), Admitted("d")]  # t = 6: 3 slots
    assert admission.slots == 3 and admission.untrusted == {"b": 0, "c": 0, "d": 0}
    assert "a" in admission.aggregated()
    assert admission.join("e") == [Queued("e", 0)]
    assert admission.approved("c") == [] and admission.approved("zz") == []
    assert admission.broke_chain("b", "missing_commitment") == [Banned("b", "missing_commitment"), Admitted("e")]
    assert admission.join("b") == []  # a banned identity cannot come back under the same key
    assert admission.ban("t0", "gradient") == [Banned("t0", "gradient")]  # 2 slots now; nobody is evicted
    assert admission.slots == 2 and admission.untrusted == {"c": 1, "d": 0, "e": 0}
    assert admission.join("f") == [Queued("f", 0)]
    with pytest.raises(ConfigError, match="admission.approvals"):
        AdmissionConfig(approvals=0)


# --- the owner's declaration against the agreed set (issue 14) ----------------------


@pytest.mark.parametrize(
    "attack, reason",
    [
        ("scaled_aggregate", "declaration"),  # -10 x the aggregate, nobody listed: never banned while checks trusted the list
        ("trimmed_declaration", "declaration"),
        ("list_nobody", "declaration"),
        ("list_other", "declaration"),
        ("hide_contributors", "v2_sum"),  # lists everyone, aggregates only itself: the sum over the agreed set fails
        ("list_extra", "declaration"),  # malformed (a part both used and dropped): bad_commit too, resolved after
        ("split_declaration", "equivocation"),
    ],
)
def test_an_owner_declaration_that_differs_from_the_agreed_set_is_banned_alone(tmp_path, attack, reason):
    summary, honest, views = _btard_run(tmp_path, attack, "byzantine.start_step=1", peers=4, steps=3)
    assert all(view == set(summary["byzantine"]) for view in views.values())
    rows = [json.loads(line) for line in (tmp_path / "bans.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["step"]) for r in rows] == [(reason, 1)]  # caught on the first step it lies
    digests = summary["final_digests"]
    assert len({digests[p] for p in honest}) == 1  # honest models, optimizers and ledgers identical


def test_an_owner_that_drops_honest_parts_pays_with_an_eliminate(tmp_path):
    # The one declaration no check can disprove ("their part never came") is an ELIMINATE: the
    # owner goes, and with it the first victim in canonical order (App. D.3), nobody else.
    summary, honest, views = _btard_run(tmp_path, "drop_honest", peers=4, steps=3)
    assert all(view == {summary["byzantine"][0], min(honest)} for view in views.values())
    digests = summary["final_digests"]
    assert len({digests[p] for p in honest if p != min(honest)}) == 1


def test_an_owner_that_withholds_its_aggregate_from_one_peer_changes_nothing(tmp_path):
    # The victim gets neither the aggregate commitment directly nor the aggregate. It fetches both from
    # the other members (the signed commitment's hash binds the aggregate), so it applies the same
    # update, owes and sends its metadata, and nobody is banned: a lie nobody can prove, made harmless.
    # Before, the victim sent no metadata for that partition, the owner claimed no_meta, and judged on
    # which aggregates reached each judge the honest ledgers split three ways.
    summary, honest, views = _btard_run(tmp_path, "withhold_aggregate", peers=5, steps=3)
    assert all(view == set() for view in views.values())
    digests = summary["final_digests"]
    assert len({digests[p] for p in honest}) == 1


def test_a_report_timed_at_the_deadline_counts_for_every_honest_peer(tmp_path):
    # late_report slanders an honest peer in a report sent to half of the others just before their
    # deadline and to the rest just after. Deciding on the reports each deadline cut, half banned the
    # slanderer and half did not (three ledgers); on the exchanged report lists, every honest peer bans it.
    summary, honest, views = _btard_run(tmp_path, "late_report", peers=5, steps=3)
    assert all(view == set(summary["byzantine"]) for view in views.values())
    assert len({summary["final_digests"][p] for p in honest}) == 1

def test_a_member_that_looks_gone_to_one_peer_is_decided_on_as_the_others_do(tmp_path, monkeypatch):
    # Peer 0's membership view lacks honest peer 1 (as over hivemind when 1's record expired at 0 only): 0
    # passes 1 over in the verification's waits (metadata, reports) as soon as the others' are in, while
    # the others wait for 1. 0 must then wait for the others' report lists, which name 1's report, and take
    # it: with the lists cut btard.timeout / 2 after 0's own early cut, 0 alone banned 1 (not_validating).
    from phalanx.transport.sim import SimTransport

    blind, hidden = peer_identity(0, 0).peer_id, peer_identity(0, 1).peer_id
    members, collect = SimTransport.members, btard_verify._collect_passing_over
    cut: list[str] = []

    def view(self):
        return [p for p in members(self) if not (self.peer_id == blind and p == hidden)]

    async def watched(state, topic, step, senders, *args):
        got = await collect(state, topic, step, senders, *args)
        if state.transport.peer_id == blind and hidden in senders and hidden not in got:
            cut.append(topic)
        return got

    monkeypatch.setattr(SimTransport, "members", view)
    monkeypatch.setattr(btard_verify, "_collect_passing_over", watched)
    summary, honest, views = _btard_run(tmp_path, "none", "btard.validators=2", peers=5, steps=2, count=0)
    assert "bt.report" in cut
    assert all(view == set() for view in views.values())
    assert len({summary["final_digests"][p] for p in honest}) == 1


def test_an_owner_that_starts_its_step_early_takes_the_commitments_that_come_in_time_for_the_others(tmp_path, monkeypatch):
    # Every peer but peer 0 starts step 1 1.5 x btard.timeout late (as a stage's replicas still settling the step
    # before while a joiner, which ran no round then, starts at once). Peer 0's commitment deadline counted from
    # its own start: it dropped their commitments as late_commit, and the ELIMINATE banned it and honest peer 1.
    # Now it counts from when half of the others' are in: nobody is banned. The parts' collect (allreduce.timeout)
    # has ended before those commitments came: their parts are collected after them (else: missing_part).
    import asyncio

    from phalanx.runtime.rounds.btard import SecureRound

    early, join = peer_identity(0, 0).peer_id, SecureRound._join

    async def late(self, step, candidates):
        if step == 1 and self.transport.peer_id != early:
            await asyncio.sleep(1.5)
        return await join(self, step, candidates)

    monkeypatch.setattr(SecureRound, "_join", late)
    summary, honest, views = _btard_run(tmp_path, "none", "allreduce.timeout=1.0", peers=5, steps=2, count=0)
    assert all(view == set() for view in views.values())
    assert len({summary["final_digests"][p] for p in honest}) == 1


def test_a_committer_timed_into_an_owners_extension_costs_no_honest_peer_but_that_owner(tmp_path, monkeypatch):
    # Byzantine peer 4 (scripted here: it runs the protocol and lies with its timing) commits so that its
    # commitment reaches owners 0 and 1 after their parts' collect ended but within their commitment deadline,
    # and sends them its parts only ~1 s later (withholding them from pulls until then). The late parts were
    # re-collected with a fresh allreduce.timeout: 0 and 1 then ended their scatter so late that the others
    # claimed missing_aggregate against them, and no_meta turned against the others: all honest peers banned.
    # Now the late part gets one pull: 4 is dropped (missing_part), and 0's ELIMINATE costs 0 alone.
    import asyncio

    from phalanx.core.envelope import SignedEnvelope
    from phalanx.runtime.rounds.btard import SecureRound
    from phalanx.runtime.rounds.butterfly import PART, ButterflyAllReduce
    from phalanx.transport.base import BROADCAST_TOPIC
    from phalanx.transport.sim import SimTransport

    x, step = peer_identity(0, 4).peer_id, 1
    victims = {peer_identity(0, 0).peer_id: 1.96, peer_identity(0, 1).peer_id: 1.99}
    send, pull, board, gather = SimTransport.send, ButterflyAllReduce._on_pull, SimTransport._serve_board, SecureRound._gather
    release: dict[str, float] = {}
    held = set()

    def now() -> float:
        return asyncio.get_running_loop().time()

    def later(delay: float, *message) -> None:
        async def go():
            await asyncio.sleep(delay)
            await send(*message)
        held.add(asyncio.ensure_future(go()))

    async def timed_send(self, peer, topic, payload):
        if self.peer_id == x and topic == BROADCAST_TOPIC:
            env = SignedEnvelope.from_bytes(payload, x)
            if env.topic == "bt.commit" and env.step == step:
                release.setdefault("commit", now() + 0.997)
                return later(0.997, self, peer, topic, payload)
        elif self.peer_id == x and topic == "ar.part" and peer in victims and decode(payload, x)["step"] == step:
            release[peer] = now() + victims[peer]
            return later(victims[peer], self, peer, topic, payload)
        return await send(self, peer, topic, payload)

    async def timed_pull(self, sender, payload):
        obj = decode(payload, sender)
        if self.transport.peer_id == x and obj.get("kind") == PART and obj.get("step") == step and now() < release.get(sender, 1e18):
            return encode({"step": step})
        return await pull(self, sender, payload)

    async def timed_board(self, sender, payload):
        obj = decode(payload, sender)
        if self.peer_id == x and obj.get("topic") == "bt.commit" and obj.get("step") == step and now() < release.get("commit", 1e18):
            return encode([])
        return await board(self, sender, payload)

    async def quiet_gather(self, st, mine, rc):  # 4 keeps to itself what its own delays make its gather claim
        if self.transport.peer_id == x and st.step == step:
            await asyncio.sleep(1.25)
        out = await gather(self, st, mine, rc)
        if self.transport.peer_id == x:
            st.claims[:] = [c for c in st.claims if c.reason not in ("bad_aggregate", "missing_aggregate", "aggregate_hash")]
        return out

    monkeypatch.setattr(SimTransport, "send", timed_send)
    monkeypatch.setattr(ButterflyAllReduce, "_on_pull", timed_pull)
    monkeypatch.setattr(SimTransport, "_serve_board", timed_board)
    monkeypatch.setattr(SecureRound, "_gather", quiet_gather)
    summary, _, views = _btard_run(tmp_path, "none", "allreduce.timeout=1.0", peers=5, steps=2, count=0)
    honest = [p for p in summary["peer_ids"] if p != x]
    assert all(views[p] == {x, peer_identity(0, 0).peer_id} for p in honest)
    assert len({summary["final_digests"][p] for p in honest}) == 1


def test_colluders_that_commit_at_once_do_not_set_an_early_owners_commitment_deadline(tmp_path, monkeypatch):
    # As the test above, peer 0 starts step 1 early and honest peers 1 and 2 start it 1.5 x btard.timeout late;
    # peers 3 and 4 (colluders, scripted: they lie only with their timing) start it with 0. They were half of
    # 0's others, so 0 counted the group's deadline from them and dropped 1's and 2's commitments (late_commit):
    # 0, 1 and 2 banned. The anchor now takes more than half of the others: one honest commitment at least.
    import asyncio

    from phalanx.runtime.rounds.btard import SecureRound

    late_peers, join = {peer_identity(0, 1).peer_id, peer_identity(0, 2).peer_id}, SecureRound._join

    async def late(self, step, candidates):
        if step == 1 and self.transport.peer_id in late_peers:
            await asyncio.sleep(1.5)
        return await join(self, step, candidates)

    monkeypatch.setattr(SecureRound, "_join", late)
    summary, _, views = _btard_run(tmp_path, "none", "allreduce.timeout=1.0", peers=5, steps=2, count=0)
    assert all(view == set() for view in views.values())


def _hide_meta_from(monkeypatch, hidden: str, blind: str) -> None:
    """`hidden` looks gone to `blind` only (its membership view) and withholds its `bt.meta` from it."""
    from phalanx.core.envelope import SignedEnvelope
    from phalanx.transport.base import BROADCAST_TOPIC
    from phalanx.transport.sim import SimTransport

    members, send = SimTransport.members, SimTransport.send

    def view(self):
        return [p for p in members(self) if not (self.peer_id == blind and p == hidden)]

    async def withheld(self, peer, topic, payload):
        if self.peer_id == hidden and peer == blind and topic == BROADCAST_TOPIC and SignedEnvelope.from_bytes(payload, hidden).topic == "bt.meta":
            return None
        return await send(self, peer, topic, payload)

    monkeypatch.setattr(SimTransport, "members", view)
    monkeypatch.setattr(SimTransport, "send", withheld)


def test_v3_runs_checkaveraging_on_every_honest_peer_when_a_member_looks_gone_to_one(tmp_path, monkeypatch):
    # Colluders 3 (an owner that refuses bt.parts) and 4 report a huge norm for 3's partition (V3's trigger).
    # 4 looks gone to honest peer 0 only and withholds its metadata from 0. 0 cut its metadata wait without
    # 4's and counted V3 on three norms of five: the others ran CHECKAVERAGING and banned 3, 0 did not, and the
    # honest models parted. V3 now counts on the agreed metadata (and the cut asks the others for 4's once).
    from phalanx.runtime.rounds import btard as btard_round

    x, owner, blind = (peer_identity(0, i).peer_id for i in (4, 3, 0))
    send_meta, serve_parts = btard_verify._send_meta, btard_round.serve_parts
    _hide_meta_from(monkeypatch, x, blind)

    async def inflated(state, st, parts, me):
        if me in (x, owner) and st.step == 1:
            report = state.policy.report
            monkeypatch.setattr(state.policy, "report", lambda step, norms, s: ({**report(step, norms, s)[0], owner: 1e6}, s))
        return await send_meta(state, st, parts, me)

    async def refused(state, sender, payload):
        return encode({"step": 1, "parts": {}}) if state.transport.peer_id == owner else await serve_parts(state, sender, payload)

    monkeypatch.setattr(btard_verify, "_send_meta", inflated)
    monkeypatch.setattr(btard_round, "serve_parts", refused)
    summary, _, views = _btard_run(tmp_path, "none", "btard.delta_max=0.4", "btard.validators=0", peers=5, steps=2, count=0)
    honest = [p for p in summary["peer_ids"] if p not in (x, owner)]
    assert all(views[p] == {owner} for p in honest)
    assert len({summary["final_digests"][p] for p in honest}) == 1


def test_a_validator_that_lacks_its_targets_metadata_does_not_approve_it(tmp_path, monkeypatch):
    # Peer 4 (scripted) computes its gradient honestly but reports a false norm for colluder 3's partition (3 does
    # not claim it), looks gone to its validator 0 only, and withholds its metadata from 0. 0 cut its metadata wait
    # without it, found the gradient clean and approved 4; 3 then accused 4 of `gradient` (judged on the agreed
    # metadata, which holds the lie): 0 was banned with 4 as covered:gradient. 0 now reports 4 unverified.
    x, colluder, validator = (peer_identity(0, i).peer_id for i in (4, 3, 0))
    send_meta, owner_checks = btard_verify._send_meta, btard_verify._owner_checks
    _hide_meta_from(monkeypatch, x, validator)

    async def lying(state, st, parts, me):
        if me == x and st.step == 1:
            report = state.policy.report
            monkeypatch.setattr(state.policy, "report", lambda step, norms, s: ({**report(step, norms, s)[0], colluder: 1e6}, s))
        if me == colluder:
            monkeypatch.setattr(state.policy, "slander", lambda step, group: [x] if step == 1 else [])
        return await send_meta(state, st, parts, me)

    monkeypatch.setattr(btard_verify, "_send_meta", lying)
    monkeypatch.setattr(btard_verify, "validator_pairs", lambda r, trusted, drawn, m: [(validator, x)])
    monkeypatch.setattr(btard_verify, "_owner_checks", lambda state, st, me: [] if me == colluder else owner_checks(state, st, me))
    summary, _, views = _btard_run(tmp_path, "none", "btard.validators=1", peers=5, steps=2, count=0)
    honest = [p for p in summary["peer_ids"] if p not in (x, colluder)]
    assert all(x in views[p] and validator not in views[p] for p in honest)


def test_a_verification_request_to_a_peer_out_of_view_leaves_time_for_the_answers_transfer():
    # A peer out of my view (maybe only to me) is asked for btard.timeout / 10, but a whole gradient (bt.grad)
    # does not cross a slow link in that: at least one pull's time for dim floats, as the all-reduce's pulls.
    import asyncio
    import types

    from phalanx.core.serialization import DEFAULT_LIMITS
    from phalanx.runtime.rounds.btard_validate import ask

    asked: list[float] = []

    class Transport:
        limits = DEFAULT_LIMITS

        def members(self) -> list[str]:
            return []

        async def request(self, peer, topic, payload, timeout):
            asked.append(timeout)
            return encode({"step": 0})

    state = types.SimpleNamespace(
        transport=Transport(), btard=BTARDConfig(timeout=1.0), allreduce=AllReduceConfig(pull_bandwidth=1e6), dim=100_000,
    )
    assert asyncio.run(ask(state, "gone", "bt.grad", {"step": 0})) == {"step": 0}
    assert asked == [pytest.approx(0.25 + 0.4)]


def test_a_no_meta_claim_is_judged_on_the_agreed_metadata():
    part = torch.ones(2)
    st = StepState(0, ["a", "b"], [(0, 2), (2, 4)], members=["a", "b"], committers=["a", "b"])
    st.commits = {"a": ([tensor_hash(part), b""], b""), "b": ([tensor_hash(part), b""], b"")}
    claim = Claim(ACCUSE, "a", "b", "no_meta", (0, part))
    assert _missing_meta(st, claim, math.inf) == [claim]  # no metadata at all: the accusation stands
    st.meta["b"] = ({}, {})
    assert _missing_meta(st, claim, math.inf) == [Claim(ELIMINATE, "a", "b", "no_meta")]  # "never came" against "never came"
    st.meta["b"] = ({"a": 1.0}, {"a": 0.0})
    assert _missing_meta(st, claim, math.inf) == []  # the metadata came after the claim: nobody is at fault
    st.z, st.z64, st.aggregates["a"] = torch.ones(4), torch.ones(4, dtype=torch.float64), torch.ones(2)
    st.meta["b"] = ({"a": 1000.0}, {"a": 0.0})
    assert _missing_meta(st, claim, math.inf) == [claim]  # ... and lies: the claim proves it (V1)
    forged = Claim(ACCUSE, "a", "b", "no_meta", (0, -part))
    assert _missing_meta(st, forged, math.inf) == [forged]  # evidence that does not hold is left to the verdict (slander)


def test_a_forger_that_will_not_send_its_gradient_is_convicted_from_its_owners_parts(tmp_path):
    # The validator's recomputation differs from the commitment and the target refuses bt.grad:
    # the parts its owners aggregated are the evidence, and no honest validator is spent on it.
    summary, honest, views = _btard_run(tmp_path, "withhold_gradient", "btard.validators=2", steps=8)
    assert all(view == set(summary["byzantine"]) for view in views.values())
    rows = [json.loads(line) for line in (tmp_path / "bans.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rows] == ["gradient"] and rows[0]["accuser"] in honest


@pytest.mark.parametrize("admission", [0, 3])
def test_a_joiner_that_catches_up_across_a_ban_takes_the_ban_with_the_replayed_updates(tmp_path, admission):
    # The joiner loads the step-10 snapshot and replays the updates since; the sign flipper is banned
    # in between. Each replayed update carries the bans that took effect in its step (and its
    # digest covers them), so the joiner's ledger, group and state equal the others'. With admission
    # the joiner's votes count only the trusted peers of the anchor chain, whose trusted set loses
    # the banned peer on the way.
    summary, honest, views = _btard_run(
        tmp_path, "sign_flip", "byzantine.start_step=11", "btard.validators=2", "faults.join=1", "faults.join_after_step=12",
        f"btard.admission_after={admission}", peers=5, steps=19,
    )
    joiner = summary["peer_ids"][5]
    assert joiner in honest and all(view == set(summary["byzantine"]) for view in views.values())
    digests = summary["final_digests"]
    assert joiner in digests and len({digests[p] for p in honest}) == 1


# --- red team (issue 14): random multi-point strategies, three invariants ---------------------


@pytest.mark.parametrize("seed", [0, 6, 24])
def test_red_team_slice_breaks_no_invariant(seed):
    trial = run_trial(seed, RedTeamConfig(steps=5))
    assert trial.moves and trial.bans  # the colluders lied and were caught
    assert trial.violations == [], trial


def test_red_team_finds_a_weakened_sum_check(monkeypatch):
    # An owner that commits and sends a shifted aggregate, declaring every part: only Σ s = 0 sees it.
    config = RedTeamConfig(steps=3, points="aggregate")
    assert run_trial(14, config).violations == []
    monkeypatch.setattr(btard_verify, "sum_checks", lambda state, st, skip: None)
    assert any("honest-only CenteredClip" in v for v in run_trial(14, config).violations)


def test_red_team_regression_equivocator_parts_judged_alike_under_either_version():
    # Found by the harness: a colluder splits its commitment and omits its metadata; the owners'
    # excused sums go to CHECKAVERAGING, which once judged the owners by whichever version each
    # honest peer held first and banned honest owners on half of the peers.
    assert run_trial(5, RedTeamConfig(steps=3, points="equivocate,report")).violations == []


@pytest.mark.parametrize(
    "seed, points",
    [
        # A declaration that lists a part as used and dropped (malformed), withheld from one honest peer,
        # which then fetched it after the gather: it kept no hash for it, so judged no `declaration` fault
        # and banned the owner for `bad_commit` instead (ledgers differ).
        (290133, "deadline_edge,declare,part,withhold_aggregate"),
        # Two colluders withhold their declarations (which do not drop each other) from one honest peer:
        # judged on the honest declarations alone, it passed both over and stepped without their
        # partitions while the others applied them (models apart; an honest gradient ban at the next step).
        (220050, "aggregate,commit,deadline_edge,part,report_edge,slander,withhold_aggregate"),
        # A colluder signs two declarations, one dropping a fellow colluder as silent and one not: the
        # honest peers holding different versions passed over different owners (models apart).
        (200171, "other_declaration,deadline_edge,declare,part,withhold_aggregate"),
    ],
)
def test_red_team_regression_a_peer_left_out_of_some_declarations_decides_as_the_others(seed, points):
    assert run_trial(seed, RedTeamConfig(steps=3, max_peers=8, points=points)).violations == []


def test_red_team_regression_an_owner_that_stops_is_passed_over_not_a_push():
    # Seed 602864: the colluder's report, timed at the deadline, missed its own agreed set, so it banned
    # itself (not_validating, its view only) and stopped; the honest peers passed its partition over at
    # step 2 (zero everywhere, as for a crashed honest owner) and it left the group. The old bound
    # counted the zero slice as a push of 0.35 > 0.333.
    trial = run_trial(602864, RedTeamConfig(steps=4, max_peers=8, points="report_edge,withhold_aggregate"))
    assert trial.moves and trial.violations == [], trial


def test_red_team_regression_declarations_passed_on_in_the_data_parallel_round_part_no_honest_verification():
    # Seed 2900059 (n = 8, three colluders, every point at rate 1) on 34ee770, which passed declarations on in the
    # data-parallel round too: two honest peers, which held a deadline_edge colluder's commitment in time, waited its
    # metadata 6 s; the others' report collection had closed at 3 s, so an honest validator was banned not_validating
    # and the honest ledgers parted.
    trial = run_trial(2900059, RedTeamConfig(steps=2, max_peers=8))
    assert trial.moves and trial.violations == [], trial


def test_red_team_bound_excuses_a_left_out_partition_only_of_a_colluder_that_goes():
    reduce = make_reducer("centered_clip", tau=1.0)
    group = ["a", "b", "c", "d"]  # "c" colludes; partition j belongs to group[j]
    rows = {p: 1 + 0.1 * torch.randn(8, generator=torch.Generator().manual_seed(i)) for i, p in enumerate("abd")}
    honest = reduce(torch.stack(list(rows.values())))
    gradients = {0: rows, 1: rows}

    def left_out(owner: str) -> torch.Tensor:
        vector = honest.clone()
        a = group.index(owner) * 2
        vector[a:a + 2] = 0
        return vector

    def check(owner: str, next_group: list[str]) -> list[str]:
        updates = {0: Update(group, left_out(owner), {owner}), 1: Update(next_group, honest.clone(), set())}
        return bounded_effect(updates, gradients, frozenset({"c"}), [], k=2)

    assert check("c", ["a", "b", "d"]) == []
    assert any("stayed in the group" in v for v in check("c", group))
    assert any("honest-only CenteredClip" in v for v in check("b", ["a", "b", "d"]))
    # A colluder that stops, stays out k steps, comes back and stops again is excused only the first time
    # (else f > k staggered colluders could zero a partition at every step).
    away = ["a", "b", "d"]
    gradients.update({s: rows for s in range(2, 6)})
    again = {0: Update(group, left_out("c"), {"c"}), 1: Update(away, honest.clone(), set()), 2: Update(away, honest.clone(), set()),
             3: Update(group, left_out("c"), {"c"}), 4: Update(away, honest.clone(), set()), 5: Update(away, honest.clone(), set())}
    assert [v for v in bounded_effect(again, gradients, frozenset({"c"}), [], k=2) if "again" in v] == ["step 3: colluder c's partition was left out again (a crash costs it once)"]


def test_a_commitment_timed_at_the_deadline_splits_nobody(tmp_path):
    # deadline_edge signs its commitment just before the others' deadline and sends it to half of
    # them then, to the rest just after. Validator pairs come from the step's roles, not from the
    # commitments each peer held by its deadline, so no honest validator is taken for a silent one.
    # An owner that did not get the commitment in time drops that part: an ELIMINATE, the price of
    # any "their part never came" (App. D.3), so the attacker goes with at most one honest owner.
    summary, honest, views = _btard_run(tmp_path, "deadline_edge", peers=5, steps=3)
    byzantine = summary["byzantine"][0]
    assert len({frozenset(v) for v in views.values()}) == 1  # one ledger
    (view,) = {frozenset(v) for v in views.values()}
    assert byzantine in view and len(view - {byzantine}) <= 1
    rows = [json.loads(line) for line in (tmp_path / "bans.jsonl").read_text().splitlines()]
    assert all(r["reason"] in ("eliminator", "eliminated:late_commit") or r["peer"] == byzantine for r in rows)
    digests = summary["final_digests"]
    assert len({digests[p] for p in honest if p not in view}) == 1


def test_an_owner_most_other_owners_dropped_as_silent_is_passed_over_whether_or_not_its_own_declaration_came():
    owners = ["a", "b", "c", "x"]
    late = {"x": "late_commit"}
    # Crashed x: the others' declarations decide it, before and after x's (slow) own arrives.
    assert passed_over(owners, {"a": late, "b": late}) is None  # c and x, undeclared, could still drop a (or b)
    assert passed_over(owners, {"a": late, "b": late, "c": late}) == {"x"}
    assert passed_over(owners, {"a": late, "b": late, "c": late, "x": {}}) == {"x"}
    # Crashed after its commitment, before its parts: dropped as missing_part (or late) by all of them.
    assert passed_over(owners, {"a": {"x": "missing_part"}, "b": late, "c": {"x": "missing_part"}}) == {"x"}
    # Silent for two of its three others: passed over even where one owner used its part (deadline_edge's in-time
    # half: the part departs with it, `late_for_most`) or got a wrong one; silent for one of three: applied.
    assert passed_over(owners, {"a": late, "b": late, "c": {}}) == {"x"}
    assert passed_over(owners, {"a": late, "b": late, "c": {"x": "part_hash"}, "x": {}}) == {"x"}
    assert passed_over(owners, {"a": late, "b": {}, "c": {}, "x": {}}) == set()
    # A lone declaration that calls every other owner late decides nothing and passes nobody over.
    everyone_late = {o: "late_commit" for o in owners}
    assert passed_over(owners, {"a": everyone_late}) is None
    assert passed_over(owners, {"a": everyone_late, "b": {}, "c": {}, "x": {}}) == set()
    assert passed_over(["a", "x"], {"a": late}) is None


def test_colluders_that_declare_each_others_parts_to_one_peer_revive_no_owner_the_others_passed_over():
    # Review s24-RB 4: r and q commit to each other only, so every honest declaration drops both as silent; each
    # declares, to honest b only, that it used the other's part. With "every other declaration held drops it" b
    # (holding them) passed nobody over and applied both partitions while a, c, d passed both over: two models. The
    # count of silent drops among the other owners' declarations only grows with what arrives.
    owners = ["a", "b", "c", "d", "q", "r"]
    honest = {p: {"q": "late_commit", "r": "late_commit"} for p in "abcd"}
    assert passed_over(owners, honest) == {"q", "r"}
    assert passed_over(owners, {**honest, "r": {}, "q": {}}) == {"q", "r"}
    assert passed_over(owners, {**honest, "r": {"a": "late_commit", "b": "late_commit"}, "q": {"a": "late_commit"}}) == {"q", "r"}


def test_a_committer_that_leaves_the_view_does_not_push_the_commitment_deadline_back():
    # Of my two other committers, A commits 0.01 s after my start and C never does: it crashed, and leaves my view
    # 2 s in. "More than half of the others in my view" holds only once C left, at the next look (2.5 s); the lag
    # was counted from then, as if A had committed 2.5 s late, and my deadline was start + T + 2.5 (the gather and
    # every later phase waited that much longer in a stage of two). The lag is A's, 0.01 s.
    import asyncio

    from phalanx.runtime.rounds.btard import SecureRound

    timeout, me, a, c = 5.0, "me", "a", "c"

    class Clock:
        t = 0.0

        def now(self) -> float:
            return self.t

    class Board:
        def arrivals(self, topic, step) -> dict[str, float]:
            return {a: 0.01}

    class Transport:  # arrivals and the view on a scripted clock; `enough` is asked at each arrival and each look
        peer_id, clock, failure_detection, board = me, Clock(), 0.0, Board()

        def members(self) -> list[str]:
            return [me, a] + ([c] if self.clock.t < 2.0 else [])

        async def collect_broadcasts(self, topic, step, senders, timeout, relays=2, enough=None, patience=None):
            end, looks = self.clock.t + timeout, [self.clock.t + k * (patience or timeout / 4) for k in range(1, 100)]
            for t in sorted({0.01, *looks}):
                if t > end:
                    break
                self.clock.t = max(self.clock.t, t)
                got = {a: "commitment"} if self.clock.t >= 0.01 else {}
                if enough is not None and enough(got):
                    return got
            self.clock.t = max(self.clock.t, end)
            return {a: "commitment"}

    round_ = SecureRound.__new__(SecureRound)
    round_.transport = Transport()
    round_.state = type("State", (), {"btard": BTARDConfig(timeout=timeout)})()
    st = StepState(1, [me, a, c], [], members=[me, a, c], committers=[me, a, c])
    asyncio.run(round_._commitments(st))
    assert round_.transport.clock.t == pytest.approx(timeout + 0.01)  # before: 7.5


def test_colluders_that_declare_before_anyone_commits_do_not_make_an_honest_peer_step_out(tmp_path, monkeypatch):
    # A member that already holds the aggregate commitments of more than half of the other owners when it would
    # commit began the step too late (an honest one among them closed its commitments) and commits nothing
    # (`SecureRound._closed_before_me`). Colluders 3 and 4 (of five: at most half of any honest peer's other
    # owners) sign declarations of step 1 before anyone commits, dropping every other owner. No honest peer may
    # step out for them: the three honest peers commit, and none is banned. Fails with "at least half" in the rule.
    import asyncio

    from phalanx.core.serialization import encode as enc
    from phalanx.runtime.rounds.btard import SecureRound

    colluders = {peer_identity(0, i).peer_id for i in (3, 4)}
    commit, closed = SecureRound._commit, SecureRound._closed_before_me
    committed: set[str] = set()

    async def early(self, st, parts):
        me = self.transport.peer_id
        if st.step == 1 and me in colluders:
            drop = {o: "late_commit" for o in st.group if o != me}
            await self.transport.broadcast("bt.rcommit", 1, enc({"g": st.g, "h": bytes(32), "from": [me], "drop": drop}))
        elif st.step == 1:
            await asyncio.sleep(0.3)  # the colluders' declarations are here before an honest peer commits
            if not closed(self, st):
                committed.add(me)
        return await commit(self, st, parts)

    monkeypatch.setattr(SecureRound, "_commit", early)
    summary, honest, views = _btard_run(tmp_path, "none", "allreduce.timeout=1.0", peers=5, steps=2, count=0)
    assert committed == set(honest) - colluders
    assert all(not (view - colluders) for view in views.values())


def test_a_member_that_never_commits_holds_no_step_for_the_transports_failure_detection(tmp_path, monkeypatch):
    # Review s23-RE MED 4. In a group of three a member that joins and never commits (alive, in view) holds each
    # honest peer's commitment anchor. The anchor was waited for 2 x btard.timeout + the transport's failure
    # detection (the membership ttl over hivemind, 20 s in btard-digits' launch): 22 s a step here, and the
    # withholder, whose own anchor held at once, timed its verification out on the honest metadata: its no_meta
    # ELIMINATE banned an honest peer. Now 3 x btard.timeout: nobody banned, one model.
    from phalanx.runtime.rounds.btard import SecureRound
    from phalanx.transport.sim import SimTransport

    withholder, commit = peer_identity(0, 2).peer_id, SecureRound._commit

    async def withhold(self, st, parts):
        if self.transport.peer_id != withholder:
            return await commit(self, st, parts)
        return False

    monkeypatch.setattr(SecureRound, "_commit", withhold)
    monkeypatch.setattr(SimTransport, "failure_detection", property(lambda self: 20.0), raising=False)
    summary, honest, views = _btard_run(tmp_path, "none", peers=3, steps=4, count=0)
    assert all(not view for view in views.values())
    assert len(set(summary["final_digests"].values())) == 1


def test_a_byzantine_that_commits_nothing_and_looks_gone_to_one_peer_gets_no_late_member_banned(tmp_path, monkeypatch):
    # Review s23-RE HIGH 1b. Honest peer 3 begins step 2 1.6 s (1.6 x btard.timeout) late. Byzantine peer 4 commits
    # nothing at step 2 and lets its record lapse at honest peer 0 only. Peer 0's anchor counted only the others in
    # its view, so it held at once (peers 1 and 2 of three) while the others needed three of four and waited for
    # peer 3: peer 0 alone dropped peer 3 late_commit, ELIMINATE(0, 3), two honest banned. The anchor is now more
    # than half of all the other committers; the view only ends the wait once every silent one has left it.
    import asyncio

    from phalanx.runtime.rounds.btard import SecureRound

    blind, late, byzantine = (peer_identity(0, i).peer_id for i in (0, 3, 4))
    join, commit, call = SecureRound._join, SecureRound._commit, SecureRound.__call__

    async def late_join(self, step, candidates):
        if step == 2 and self.transport.peer_id == late:
            await asyncio.sleep(1.6)
        return await join(self, step, candidates)

    async def withhold(self, st, parts):
        if self.transport.peer_id == byzantine and st.step == 2:
            return False
        return await commit(self, st, parts)

    async def blind_round(self, step, vector, group):
        tr = self.transport
        if tr.peer_id == blind and step == 2:
            members = type(tr).members.__get__(tr)
            tr.members = lambda: [p for p in members() if p != byzantine]
            try:
                return await call(self, step, vector, group)
            finally:
                del tr.members
        return await call(self, step, vector, group)

    monkeypatch.setattr(SecureRound, "_join", late_join)
    monkeypatch.setattr(SecureRound, "_commit", withhold)
    monkeypatch.setattr(SecureRound, "__call__", blind_round)
    summary, honest, views = _btard_run(tmp_path, "none", peers=5, steps=4, count=0)
    honest = [p for p in honest if p != byzantine]
    assert all(not (views[p] - {byzantine}) for p in honest)
    assert len({summary["final_digests"][p] for p in honest}) == 1
