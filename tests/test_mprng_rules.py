"""MPRNG rules and the ban ledger, without a network."""

import os

from phalanx.algorithms.btard.bans import BanLedger, BanRecord
from phalanx.algorithms.btard.mprng import Reveal, choose, commitment, resolve


def _round(peers):
    values = {p: (os.urandom(32), os.urandom(32)) for p in peers}
    commits = {p: commitment(p, x, s) for p, (x, s) in values.items()}
    reveals = {p: Reveal(x, s) for p, (x, s) in values.items()}
    return values, commits, reveals


def test_output_is_xor_of_reveals():
    values, commits, reveals = _round(["a", "b", "c"])
    outcome = resolve(commits, reveals)
    expected = bytes(x ^ y ^ z for x, y, z in zip(*(values[p][0] for p in "abc")))
    assert outcome.value == expected and outcome.misbehaving == ()


def test_missing_and_mismatched_reveals_are_named():
    values, commits, reveals = _round(["a", "b", "c", "d"])
    del reveals["b"]
    reveals["c"] = Reveal(os.urandom(32), values["c"][1])
    outcome = resolve(commits, reveals)
    assert outcome.value is None
    assert [(m.peer, m.reason) for m in outcome.misbehaving] == [("b", "no_reveal"), ("c", "bad_reveal")]


def test_commitment_binds_peer_identity():
    x, s = os.urandom(32), os.urandom(32)
    assert commitment("a", x, s) != commitment("b", x, s)
    _, commits, reveals = _round(["a", "b"])
    commits["a"] = commitment("b", reveals["a"].value, reveals["a"].salt)  # replayed under another id
    assert resolve(commits, reveals).misbehaving[0].peer == "a"


def test_choose_is_deterministic_distinct_and_driven_by_the_value():
    options = [f"p{i}" for i in range(10)]
    value = os.urandom(32)
    picked = choose(value, list(reversed(options)), 3)
    assert picked == choose(value, options, 3)
    assert len(set(picked)) == 3 and set(picked) <= set(options)
    draws = {tuple(choose(bytes([i]) * 32, options, 3)) for i in range(20)}
    assert len(draws) > 10  # the value, not the option order, decides


def test_ban_ledger_canonical_order_ignores_banned_accusers():
    records = [BanRecord(5, "x", "accused", accuser="y"), BanRecord(5, "y", "bad_reveal")]
    one, two = BanLedger(), BanLedger()
    one.apply(records)
    two.apply(list(reversed(records)))
    assert one.banned == two.banned
    assert one.is_banned("x") and one.is_banned("y")
    ledger = BanLedger()
    ledger.apply([BanRecord(1, "y", "bad_reveal")])
    ledger.apply([BanRecord(2, "x", "accused", accuser="y")])
    assert not ledger.is_banned("x") and ledger.filter(["x", "y", "z"]) == ["x", "z"]
