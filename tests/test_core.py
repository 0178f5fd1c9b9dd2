"""Core: identities, envelopes, canonical encoding, limits, seeded streams."""

import math

import pytest
import torch

from phalanx.core import (
    EquivocationProof,
    Identity,
    Limits,
    RemoteError,
    SignedEnvelope,
    check_tensor,
    decode,
    derive_seed,
    encode,
    peer_id_of,
    torch_stream,
)


def test_peer_id_is_hash_of_public_key_and_seeded_identity_is_deterministic():
    a, b = Identity.from_seed(b"a"), Identity.from_seed(b"a")
    assert a.peer_id == b.peer_id == peer_id_of(a.public_key)
    assert Identity.from_seed(b"b").peer_id != a.peer_id
    assert len(a.peer_id) == 32


def test_envelope_roundtrip_and_tampering_detected():
    me = Identity.from_seed(b"me")
    env = SignedEnvelope.create(me, "topic", 7, b"payload")
    parsed = SignedEnvelope.from_bytes(env.to_bytes(), "relay").verify()
    assert parsed == env
    forged = SignedEnvelope(env.sender, env.public_key, env.topic, env.step, b"other", env.signature)
    with pytest.raises(RemoteError) as exc:
        forged.verify()
    assert exc.value.evidence.kind == "bad_signature"
    impostor = Identity.from_seed(b"impostor")
    swapped = SignedEnvelope(env.sender, impostor.public_key, env.topic, env.step, env.payload, impostor.sign(env.digest()))
    with pytest.raises(RemoteError, match="does not hash"):
        swapped.verify()


def test_equivocation_proof_checks_only_real_equivocation():
    me = Identity.from_seed(b"me")
    one = SignedEnvelope.create(me, "t", 1, b"x")
    two = SignedEnvelope.create(me, "t", 1, b"y")
    assert EquivocationProof(one, two).check()
    assert not EquivocationProof(one, SignedEnvelope.create(me, "t", 2, b"y")).check()
    assert not EquivocationProof(one, one).check()
    assert EquivocationProof(one, two).evidence().kind == "equivocation"


def test_encoding_is_canonical_and_roundtrips_tensors():
    message = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": [1, 2.5, None, b"raw", "s"], "n": math.inf}
    data = encode(message)
    assert data == encode(dict(reversed(list(message.items()))))
    out = decode(data, "peer")
    assert torch.equal(out["b"], message["b"]) and out["b"].dtype == torch.float32
    assert out["a"] == [1, 2.5, None, b"raw", "s"] and out["n"] == math.inf
    bf = decode(encode({"t": torch.ones(3, dtype=torch.bfloat16)}), "p")["t"]
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, torch.ones(3, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "mutate, kind",
    [
        (lambda d: b"XXXX" + d[4:], "malformed"),
        (lambda d: d[:-3], "malformed"),
        (lambda d: d + b"\x00" * 8, "malformed"),
    ],
)
def test_malformed_bytes_are_evidence_against_sender(mutate, kind):
    data = encode({"t": torch.zeros(4)})
    with pytest.raises(RemoteError) as exc:
        decode(mutate(data), "villain")
    assert exc.value.evidence.peer == "villain" and exc.value.evidence.kind == kind


def test_limits_and_bad_tensor_metadata():
    data = encode({"t": torch.zeros(1000)})
    with pytest.raises(RemoteError) as exc:
        decode(data, "big", Limits(max_message_bytes=100))
    assert exc.value.evidence.kind == "oversize"
    with pytest.raises(RemoteError) as exc:
        decode(data, "big", Limits(max_tensor_elements=10))
    assert exc.value.evidence.kind == "oversize"
    lying = data.replace(b'"shape":[1000]', b'"shape":[1001]')
    with pytest.raises(RemoteError, match="needs 4004 bytes"):
        decode(lying, "liar")
    unknown = data.replace(b'"float32"', b'"object1"')
    with pytest.raises(RemoteError, match="not allowed"):
        decode(unknown, "liar")


def test_no_pickle_on_the_wire():
    class Thing:
        pass

    with pytest.raises(TypeError):
        encode({"x": Thing()})


def test_check_tensor_shape_dtype_finite():
    good = torch.ones(3)
    assert check_tensor(good, "p", shape=(3,), dtype=torch.float32) is good
    for bad, kind in [
        (torch.ones(4), "wrong_shape"),
        (torch.ones(3, dtype=torch.float64), "wrong_dtype"),
        (torch.tensor([1.0, float("nan"), 0.0]), "non_finite"),
        (torch.tensor([1.0, float("inf"), 0.0]), "non_finite"),
    ]:
        with pytest.raises(RemoteError) as exc:
            check_tensor(bad, "p", shape=(3,), dtype=torch.float32)
        assert exc.value.evidence.kind == kind


def test_seeded_streams_depend_on_every_part():
    assert derive_seed(1, "peer", 3, "batch") == derive_seed(1, "peer", 3, "batch")
    seeds = {derive_seed(1, "peer", 3, "batch"), derive_seed(2, "peer", 3, "batch"), derive_seed(1, "peer", 4, "batch"), derive_seed(1, "other", 3, "batch")}
    seeds.add(derive_seed(1, "peer", 3, "other"))
    assert len(seeds) == 5
    assert torch.equal(torch.rand(5, generator=torch_stream(0, "x")), torch.rand(5, generator=torch_stream(0, "x")))
    assert not torch.equal(torch.rand(5, generator=torch_stream(0, "x")), torch.rand(5, generator=torch_stream(0, "y")))


@pytest.mark.parametrize(
    "header",
    [
        b'{"x":' + b"9" * 5000 + b"}",  # int beyond Python's digit limit
        b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the JSON parser's recursion
        b'{"t":{"__t":0,"dtype":["float32"],"shape":[1]}}',  # unhashable dtype
        b'{"t":{"__t":0,"dtype":"float32","shape":[0,100000000000000000000]}}',  # absurd dimension
        b'{"t":{"__t":0,"dtype":"float32","shape":[true]}}',  # bool is not a dimension
        b"\xff\xfe",  # not UTF-8
    ],
)
def test_crafted_headers_are_evidence_not_crashes(header):
    import struct

    data = b"PHX1" + struct.pack("<I", len(header)) + header + struct.pack("<Q", 4) + b"\x00" * 4
    with pytest.raises(RemoteError) as exc:
        decode(data, "villain")
    assert exc.value.evidence.peer == "villain" and exc.value.evidence.kind in ("malformed", "oversize")
