"""Sybil-resistant admission (BTARD App. F) in simulated BTARD runs with peers joining mid-run."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from phalanx.algorithms.btard.admission import Admission, AdmissionConfig, Roles
from phalanx.algorithms.btard.anchor import Link, genesis, verify_chain, walk_chain
from phalanx.core.envelope import SignedEnvelope
from phalanx.core.errors import ConfigError
from phalanx.core.identity import Identity
from phalanx.core.serialization import DEFAULT_LIMITS, decode, encode
from phalanx.runs.config import override
from phalanx.runs.dp.churn import FaultDriver
from phalanx.runs.dp.simulate import simulate
from phalanx.runs.presets import get_preset
from phalanx.runtime.dp import admission as admission_service
from phalanx.runtime.dp.catchup import CatchupConfig, CatchupFailed

T = 3  # approvals a joiner needs in these runs
BASE = ["peers=4", "steps=24", "byzantine.count=0", "btard.timeout=1.0", "train.eval_every=1", f"btard.admission_after={T}"]
JOIN = ["faults.join_after_step=2"]


def _run(path, *extra):
    summary = simulate(override(get_preset("btard-digits"), [*BASE, *extra]), path, progress=False)
    metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    events = path / "admissions.jsonl"
    admissions = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    return summary, metrics, admissions


def _losses(metrics):
    return [m["test_loss"] for m in metrics]


def _agree(summary, metrics):
    """(d) every honest peer, joiners included, held the same trusted/untrusted/queued sets at every step."""
    rows = [m for m in metrics if "admission_agree" in m]
    assert rows and all(m["admission_agree"] for m in rows)
    honest = [p for p in summary["peer_ids"] if p not in summary["byzantine"] and p in summary["banned_by_peer"]]
    assert len({json.dumps(sorted(summary["banned_by_peer"][p])) for p in honest}) == 1


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The same run without any joiner."""
    return _run(tmp_path_factory.mktemp("baseline"))


def test_honest_joiner_is_aggregated_only_after_t_approvals(tmp_path, baseline):
    summary, metrics, admissions = _run(tmp_path, "faults.join=1", *JOIN)
    joiner = summary["peer_ids"][4]
    mine = [(a["step"], a["event"]) for a in admissions if a["peer"] == joiner]
    entered = mine[0][0]
    assert mine[0] == (entered, "untrusted")  # a free slot (t=4: 2 slots): untrusted at once
    approvals = [s for s, e in mine if e == "approved"]
    trusted_at = next(s for s, e in mine if e == "trusted")
    assert len(approvals) == T and approvals[-1] == trusted_at  # trusted at the step of its T-th approval
    assert [e for _, e in mine] == ["untrusted", *["approved"] * T, "trusted"]
    assert entered > 2 and trusted_at < 20
    for m in metrics:
        assert m["untrusted"] == (1 if entered <= m["step"] <= trusted_at else 0)
        assert m["trusted"] == (5 if m["step"] > trusted_at else 4)
    # Until its promotion the model is exactly the one trained without it (its gradient was never
    # aggregated); from the next step on its gradient is in the average and the trajectory moves.
    assert _losses(metrics)[: trusted_at + 1] == _losses(baseline[1])[: trusted_at + 1]
    assert _losses(metrics)[trusted_at + 1 :] != _losses(baseline[1])[trusted_at + 1 :]
    assert summary["banned"] == []
    assert len(set(summary["final_digests"].values())) == 1
    _agree(summary, metrics)


def test_lying_joiner_is_banned_before_it_is_ever_trusted_and_never_moves_the_model(tmp_path, baseline):
    lie = ["faults.join=1", *JOIN, "byzantine.joiners=1", "byzantine.attack=sign_flip", "byzantine.start_step=0"]
    summary, metrics, admissions = _run(tmp_path, *lie)
    joiner = summary["peer_ids"][4]
    assert summary["byzantine"] == [joiner]
    assert [a["event"] for a in admissions if a["peer"] == joiner] == ["untrusted", "banned:gradient"]
    assert summary["banned"] == [joiner]
    assert _losses(metrics) == _losses(baseline[1])  # its sign-flipped gradient never entered the average
    _agree(summary, metrics)
    # Without admission (btard.admission_after=0) the same joiner is aggregated until a validator catches it.
    _, open_metrics, _ = _run(tmp_path / "open", *lie, "btard.admission_after=0")
    assert _losses(open_metrics) != _losses(baseline[1])


def test_at_most_half_as_many_untrusted_as_trusted_the_rest_queued_in_id_order(tmp_path):
    summary, metrics, admissions = _run(tmp_path, "faults.join=3", *JOIN, "steps=30")
    joiners = summary["peer_ids"][4:]
    first = min(a["step"] for a in admissions)
    at_entry = [(a["peer"], a["event"]) for a in admissions if a["step"] == first and a["event"] in ("untrusted", "queued")]
    first_two, last = sorted(joiners)[:2], sorted(joiners)[2]
    assert at_entry == [(first_two[0], "untrusted"), (first_two[1], "untrusted"), (last, "queued")]
    for m in metrics:
        assert m["untrusted"] <= m["trusted"] // 2
    assert any(m["queued"] == 1 for m in metrics)
    # The queued peer gets the slot freed when the first of the others becomes trusted, in that same step.
    first_trusted = min(a["step"] for a in admissions if a["event"] == "trusted")
    assert (last, "untrusted") in [(a["peer"], a["event"]) for a in admissions if a["step"] == first_trusted]
    assert {a["peer"] for a in admissions if a["event"] == "trusted"} == set(joiners)
    assert metrics[-1]["trusted"] == 7 and metrics[-1]["untrusted"] == metrics[-1]["queued"] == 0
    assert summary["banned"] == []
    _agree(summary, metrics)


def test_admission_state_round_trips_and_gives_roles():
    state = Admission(["t0", "t1", "t2", "t3"], AdmissionConfig(approvals=2))
    state.join("a"), state.join("b"), state.join("c")
    state.approved("a")
    copy = Admission.from_dict(json.loads(json.dumps(state.to_dict())))
    assert copy.to_dict() == state.to_dict() and copy.queue == ["c"]
    assert copy.roles(["t0", "t1", "a", "c", "x"]) == Roles(("t0", "t1"), ("a", "t0", "t1"))
    assert [copy.status(p) for p in ("t0", "a", "c", "x")] == ["trusted", "untrusted", "queued", "unknown"]
    with pytest.raises(ValueError):
        Admission.from_dict({**state.to_dict(), "untrusted": {"a": -1}})
    with pytest.raises(ConfigError, match="btard.admission_after"):
        override(get_preset("btard-digits"), ["btard.admission_after=-1"])
    with pytest.raises(ConfigError, match="byzantine.joiners"):
        override(get_preset("btard-digits"), ["byzantine.joiners=1"])


def test_a_trusted_peer_that_crashes_mid_verification_departs_unbanned_and_leaves_t(tmp_path):
    # It crashes while its step is verified (no reveal, no metadata, no report): App. F makes it
    # departed, not banned; nobody pays as its eliminator; t (and so the untrusted slots) shrinks.
    summary, metrics, admissions = _run(tmp_path, "peers=5", "steps=8", "faults.crash=1", "faults.crash_after_step=3", "faults.join=1", "faults.join_after_step=6")
    assert summary["banned"] == [] and all(v == [] for v in summary["banned_by_peer"].values())
    departed = [(a["peer"], a["step"]) for a in admissions if a["event"] == "departed"]
    assert len(departed) == 1 and departed[0][1] == 4
    assert [m["trusted"] for m in metrics] == [5] * 5 + [4] * 3  # out of t from the step after it departed
    honest = [p for p in summary["final_digests"] if p != departed[0][0]]
    assert len({summary["final_digests"][p] for p in honest}) == 1
    _agree(summary, metrics)


def test_a_restarted_trusted_peer_comes_back_through_admission(tmp_path):
    # App. F: a trusted peer that crashes departs (not banned); restarted with its identity it
    # catches up and re-enters as a joiner: untrusted, then trusted after T approvals. Nobody crashes.
    summary, metrics, admissions = _run(tmp_path, "peers=5", "steps=20", "faults.crash=1", "faults.crash_after_step=3", "faults.restart_after=2")
    assert summary["banned"] == [] and all(v == [] for v in summary["banned_by_peer"].values())
    peer = next(a["peer"] for a in admissions if a["event"] == "departed")
    mine = [a["event"] for a in admissions if a["peer"] == peer]
    assert mine == ["departed", "untrusted", *["approved"] * T, "trusted"]
    assert metrics[-1]["trusted"] == 5 and metrics[-1]["untrusted"] == 0
    assert len(set(summary["final_digests"].values())) == 1 and peer in summary["final_digests"]
    _agree(summary, metrics)


def test_a_crashed_trusted_peer_costs_the_survivors_about_one_timeout(tmp_path):
    # The peer dies after step 2, mid-verification of it: it is waited for in full once in each step (its
    # MPRNG reveal of step 2, its commitment of step 3), and after that only a grace: the survivors' step 3
    # takes ~1 timeout of simulated time (before the pass-over rules: 6, as long as their every later wait).
    timeout = 5.0
    crash = ["peers=4", "steps=5", "train.eval_every=5", f"btard.timeout={timeout}", f"allreduce.timeout={timeout}",
             "faults.crash=1", "faults.crash_after_step=2", "faults.restart_after=10"]  # no restart: churn on, for App. F
    summary, metrics, admissions = _run(tmp_path, *crash)
    victim = next(iter(summary["crashed"]))
    survivors = [i for i, p in enumerate(summary["peer_ids"][:4]) if p != victim]
    for i in survivors:
        steps = {r["step"]: r["t_end"] - r["t_start"] for r in map(json.loads, (tmp_path / "peers" / f"{i}.jsonl").read_text().splitlines())}
        assert steps[3] <= 2 * timeout and steps[4] <= timeout, steps
    assert [(a["peer"], a["event"], a["step"]) for a in admissions if a["event"] == "departed"] == [(victim, "departed", 3)]
    assert summary["banned"] == []
    assert len({summary["final_digests"][p] for p in summary["final_digests"] if p != victim}) == 1
    _agree(summary, metrics)


def _sybils(monkeypatch, count):
    """`count` Sybil identities in every run's network: members that never train, answer a joiner's
    catch-up offers with a snapshot of their own, its admission-state request with a made-up state
    that lists only themselves as trusted, and its anchor request with a chain they signed from a
    genesis of their own, one from the real genesis (signed by nobody the joiner trusts), and the
    honest chain (fetched from an honest peer) with a link of their own after its end."""
    made_up = {"approvals": T, "trusted": [], "untrusted": {}, "queue": [], "banned": []}
    original = FaultDriver.__init__

    def with_sybils(self, config, network, transports, *args, **kwargs):
        original(self, config, network, transports, *args, **kwargs)
        identities = [Identity.from_seed(f"sybil/{i}".encode()) for i in range(count)]
        made_up["trusted"] = sorted(i.peer_id for i in identities)
        initial = [t.peer_id for t in transports[: config.peers]]
        chain = []
        for prev in (genesis(made_up["trusted"]), genesis(initial)):
            link = Link(0, prev, b"model", b"ledger", tuple(made_up["trusted"])).to_bytes()
            signed = [SignedEnvelope.create(i, "bt.join", 1, link) for i in identities]
            chain.append([link, [[e.sender, e.public_key, e.signature] for e in signed]])
        answers = {
            "catchup.offer": {"latest": config.steps, "snapshots": {"0": b"made-up"}, "updates": {}, "roster": {}},
            "catchup.manifest": {"manifest": None},
            "catchup.chunk": {"data": None},
            "catchup.updates": {"vectors": None},
            "adm.state": {"state": made_up},
        }
        async def chain_answer(transport, payload):
            honest = decode(await transport.request(initial[0], "adm.chain", payload, 5.0), initial[0])["links"]
            if honest:  # a rival for the step after the honest end, signed by them (and winning a tie on bytes)
                last = Link.from_bytes(honest[-1][0], initial[0])
                forged = Link(last.step + 1, last.digest(), b"\xff" * 32, b"ledger", tuple(made_up["trusted"])).to_bytes()
                signed = [SignedEnvelope.create(i, "bt.join", last.step + 2, forged) for i in identities]
                honest.append([forged, [[e.sender, e.public_key, e.signature] for e in signed]])
            return encode({"links": chain + honest})

        for identity in identities:
            transport = network.add_peer(identity)
            for topic, answer in answers.items():
                transport.add_request_handler(topic, lambda sender, payload, answer=answer: _answer(answer))
            transport.add_request_handler("adm.chain", lambda sender, payload, transport=transport: chain_answer(transport, payload))

    monkeypatch.setattr(FaultDriver, "__init__", with_sybils)
    return made_up


async def _answer(obj):
    return encode(obj)


def test_sybils_that_outnumber_the_swarm_win_no_vote_of_a_joiner(tmp_path, monkeypatch):
    # Five Sybils against four trusted peers: counting every unbanned member, their snapshot won
    # catch-up's vote (the joiner never caught up) and their state won the admission-state vote.
    # Anchored to the chain from the initial set, only the trusted peers vote.
    made_up = _sybils(monkeypatch, 5)
    monkeypatch.setattr(admission_service, "CHAIN_PAGE", 4)  # the joiner fetches the chain in several pages
    services = []
    built = admission_service.AdmissionService.__init__
    monkeypatch.setattr(admission_service.AdmissionService, "__init__", lambda self, *a, **k: (built(self, *a, **k), services.append(self))[0])
    summary, metrics, admissions = _run(tmp_path, "faults.join=1", *JOIN, "steps=16")
    joiner = summary["peer_ids"][4]
    entered = next(a["step"] for a in admissions if a["peer"] == joiner)
    anchor = next(s for s in services if s.transport.peer_id == joiner)._tip
    assert anchor is not None and anchor.step >= entered - 3  # it verified the chain to where the swarm stood
    # Its chain is the swarm's to the end (no Sybil link kept past what it verified), so it links and signs.
    chains = {s.transport.peer_id: s.links for s in services}
    assert all(chains[joiner] == chains[p] for p in summary["peer_ids"][:4])
    assert [a["event"] for a in admissions if a["peer"] == joiner] == ["untrusted", *["approved"] * T, "trusted"]
    assert not set(made_up["trusted"]) & {a["peer"] for a in admissions}
    assert metrics[-1]["trusted"] == 5
    assert len(set(summary["final_digests"].values())) == 1 and joiner in summary["final_digests"]
    _agree(summary, metrics)


def test_the_anchor_chain_verifies_only_links_a_majority_of_the_last_trusted_set_signed():
    initial = ["a", "b", "c", "d"]
    first = Link(0, genesis(initial), b"m0", b"l0", ("a", "b", "c", "d"))
    grown = Link(1, first.digest(), b"m1", b"l1", ("a", "b", "c", "d", "e"))  # e became trusted
    after = Link(2, grown.digest(), b"m2", b"l2", ("a", "b", "c", "d", "e"))
    honest = {0: {first: {"a", "b", "c"}}, 1: {grown: {"a", "b", "c"}}, 2: {after: {"a", "b", "e"}}}
    assert verify_chain(initial, honest) == [first, grown, after]
    # Two of four is no majority: step 1 carries the chain unverified, and step 2 is judged by the set
    # of step 0 (e not in it): a, b and e are two of four again.
    thin = {**honest, 1: {grown: {"a", "b"}}}
    assert verify_chain(initial, thin) == [first]
    assert verify_chain(initial, {**thin, 2: {after: {"a", "b", "c"}}}) == [first, after]
    # Sybils: a link listing only themselves, signed by all of them, verifies nothing (neither from their
    # own genesis nor as a rival of step 1), and a broken `prev` ends the chain.
    sybils = ("x", "y", "z", "w", "v")
    rival = Link(1, first.digest(), b"m1", b"l1", sybils)
    assert verify_chain(initial, {0: {Link(0, genesis(sybils), b"m", b"l", sybils): set(sybils)}}) == []
    assert verify_chain(initial, {**honest, 1: {grown: {"a", "b", "c"}, rival: set(sybils)}}) == [first, grown, after]
    assert verify_chain(initial, {**honest, 2: {Link(2, b"elsewhere", b"m2", b"l2", after.trusted): {"a", "b", "e"}}}) == [first, grown]
    assert Link.from_bytes(after.to_bytes(), "a") == after and Link.from_bytes(b"junk", "a") is None
    # What a replica serves: consecutive links from a step, cut where the byte strings would pass a budget.
    held = SimpleNamespace(links={0: first, 1: grown, 2: after}, signed={s: {p: (b"key", b"sig") for p in "abc"} for s in range(3)})
    assert [r[0] for r in admission_service.AdmissionService._chain_rows(held, 1, 64)] == [grown.to_bytes(), after.to_bytes()]
    assert len(admission_service.AdmissionService._chain_rows(held, 0, 64, blobs=13)) == 1  # 7 strings a link


# --- the anchor against made-up, tied and stalled chains (pure: a bare service, a scripted swarm) ---


class _Swarm:
    """A joiner's transport: `serve(peer, start)` answers `adm.chain`, `states` answer `adm.state`."""

    def __init__(self, members, serve, states=None):
        self.peer_id, self.limits, self.evidence, self.asked = "joiner", DEFAULT_LIMITS, [], []
        self._members, self._serve, self._states, self._now = members, serve, states or {}, 0.0
        self.clock = self

    def now(self):
        self._now += 1.0
        return self._now

    def members(self):
        return list(self._members)

    def report(self, evidence):
        self.evidence.append(evidence)

    async def request(self, peer, topic, payload, timeout):
        if topic == "adm.chain":
            start = decode(payload, peer)["from"]
            self.asked.append((peer, start))
            rows = self._serve(peer, start)
            return encode({"links": rows, "more": bool(rows)})
        return encode({"state": self._states.get(peer)})


def _bare_service(transport, initial):
    """An AdmissionService with only what the chain fetch and the state vote use."""
    service = admission_service.AdmissionService.__new__(admission_service.AdmissionService)
    service.transport, service.initial = transport, sorted(initial)
    service.peer = SimpleNamespace(ledger=SimpleNamespace(filter=lambda members: members))
    service.catchup = SimpleNamespace(config=CatchupConfig(request_timeout=1.0, poll=0.001, timeout=3.0))
    service.links, service.signed, service._tip = {}, {}, None
    service._candidates, service._offers, service._checked = {}, {}, {}
    return service


def _signed_chain(keys, trusted_at, signers_at, steps):
    """Rows of a chain whose link s lists `trusted_at(s)` and carries the joins of `signers_at(s)`."""
    rows, prev = [], genesis(trusted_at(0))
    for s in range(steps):
        link = Link(s, prev, b"m%d" % s, b"l", tuple(sorted(trusted_at(s))))
        joins = [SignedEnvelope.create(keys[p], "bt.join", s + 1, link.to_bytes()) for p in sorted(signers_at(s))]
        rows.append([link.to_bytes(), [[e.sender, e.public_key, e.signature] for e in joins]])
        prev = link.digest()
    return rows


def test_a_member_that_makes_up_pages_without_end_is_asked_about_one_page_past_the_signed_chain(monkeypatch):
    # The Sybil serves the real chain (steps 0-5 signed by a majority, step 6 the unsigned tip), then
    # links it makes up that continue it (right `prev`) with 50 signatures of names nobody trusts.
    # Following unverified links, the joiner asked for pages without end (here: until the Sybil's 50th),
    # kept every made-up link and checked every listed signature. Now: pages only while the *verified*
    # tip reaches a page's end, made-up links never kept, only the voters' signatures checked.
    monkeypatch.setattr(admission_service, "CHAIN_PAGE", 4)
    keys = {n: Identity.from_seed(n.encode()) for n in "abcd"}
    initial = sorted(k.peer_id for k in keys.values())
    rows = _signed_chain({k.peer_id: k for k in keys.values()}, lambda s: initial, lambda s: initial[:3] if s < 6 else [], 7)
    junk = [[f"nobody{i}", b"k", b"s"] for i in range(50)]

    made = [Link.from_bytes(row[0], "x") for row in rows]
    while len(made) < 300:  # one made-up continuation, the same on every page
        made.append(Link(len(made), made[-1].digest(), b"made-up", b"l", tuple(initial)))

    def serve(peer, start):
        if len(transport.asked) > 50:
            return []
        return rows[start:start + 4] + [[link.to_bytes(), junk] for link in made[max(start, len(rows)):start + 4]]

    transport = _Swarm(["sybil"], serve)
    service = _bare_service(transport, initial)
    checks = []
    verify = SignedEnvelope.verify
    monkeypatch.setattr(SignedEnvelope, "verify", lambda self: (checks.append(self.sender), verify(self))[1])
    tip = asyncio.run(service._refresh_chain())
    assert tip is not None and tip.step == 5 and len(transport.asked) <= 3, (tip, transport.asked)
    assert sorted(service.links) == list(range(6)) and all(service.links[s].to_bytes() == rows[s][0] for s in range(6))
    assert len(checks) <= 3 * 6 and not any(c.startswith("nobody") for c in checks)
    assert sum(len(links) for links in service._candidates.values()) <= 4


def test_an_unsigned_rival_of_the_unsigned_tip_link_is_not_followed():
    # The honest tip link has no signatures until the next step's joins; a link anybody makes up for
    # the same step has none either. The tie was broken by bytes, so the made-up one could win and the
    # joiner link its own steps from it. Now a tie ends the path before the step.
    initial = ("a", "b", "c", "d")
    first = Link(0, genesis(initial), b"m0", b"l0", initial)
    tip = Link(1, first.digest(), b"m1", b"l1", initial)
    forged = max((Link(1, first.digest(), bytes([i]) * 32, b"l1", initial) for i in range(256)), key=Link.to_bytes)
    assert walk_chain(initial, {0: {first: {"a", "b", "c"}}, 1: {tip: set(), forged: set()}}) == [(first, True)]
    assert walk_chain(initial, {0: {first: {"a", "b", "c"}}, 1: {tip: {"a"}, forged: set()}}) == [(first, True), (tip, False)]


def test_a_chain_that_stalled_far_behind_the_step_anchors_no_vote():
    # Trusted {a, b, c, d}: d withholds its signature, c crashed, so a and b (2 of 4) never verify a link
    # after step 0 and the electorate stays {a, b, c, d}. Once a and b are gone only d answers: its
    # made-up state won the joiner's admission-state vote alone. Now the joiner fails closed.
    keys = {n: Identity.from_seed(n.encode()) for n in "abcd"}
    ids = {n: k.peer_id for n, k in keys.items()}
    initial = sorted(ids.values())
    later = sorted([ids["a"], ids["b"], ids["d"]])
    rows = _signed_chain({k.peer_id: k for k in keys.values()}, lambda s: initial if s == 0 else later,
                         lambda s: [ids["a"], ids["b"], ids["c"]] if s == 0 else [ids["a"], ids["b"]], 40)
    forged = Admission([ids["d"]], AdmissionConfig(T)).to_dict()
    transport = _Swarm([ids["d"]], lambda peer, start: rows[start:start + admission_service.CHAIN_PAGE], {ids["d"]: forged})
    service = _bare_service(transport, initial)
    with pytest.raises(CatchupFailed):
        asyncio.run(service._fetch(40))
    assert service._tip is not None and service._tip.step == 0
