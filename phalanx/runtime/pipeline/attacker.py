"""A malicious relay: it runs the pipeline protocol and computes its stage honestly, then lies on its links
(or, with target `aggregation`, in its stage's gradient all-reduce).

Each outgoing activation and input gradient goes through a
`algorithms.sentinel.attacks.LinkAttack` policy before it is sent; `log` receives
one record per tensor (the attack log, the experiment's ground truth; no
verifier reads it). `probe(kind, link, tensor)` is the white-box view an
adaptive attacker may be lent in experiments (None: no view); `probe(kind, link, tensor, key)`. A framing
policy (`attack.frames`) also rewrites its forward carries: the previous
stage's peer in the path, and the sender named by that link's verifier record,
become a victim of its choice (the record's signature then no longer holds).
With target `weights` it lies to peers that download its stage's weights (a joiner, a behind replica):
it claims `lead` versions more than it holds, serves the policy's weights under that version with a
digest that matches them, and when asked to confirm another replica's digest it answers that version
with its own forged digest (it disagrees with every honest source).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ...algorithms.sentinel.attacks import ACTIVATION, AGGREGATION, WEIGHTS, LinkAttack, LinkView
from ...core.serialization import digest, encode
from . import messages as m
from .relay import Relay

Probe = Callable[[str, int, torch.Tensor, m.Key], bool]


class AttackingRelay(Relay):
    """A relay whose outgoing tensors are chosen by a link attack policy."""

    def __init__(self, *args, attack: LinkAttack, log: Callable[[dict], None], probe: Probe | None = None,
                 lead: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.attack = attack
        self.log = log
        self.probe = probe
        self.lead = lead

    async def _on_weights(self, sender: str, payload: bytes) -> bytes:
        if self.attack.target != WEIGHTS or not self.attack.active(LinkView(WEIGHTS, self.version, WEIGHTS, self.params[0])):
            return await super()._on_weights(sender, payload)
        obj = m.parse_mapping(payload, sender, self.transport.limits, "weights request")
        asked, full = obj.get("version"), obj.get("full") is True
        claimed = self.version + self.lead
        forged = [self.attack.relay(LinkView(WEIGHTS, self.version, (WEIGHTS, i), p.detach())).tensor.to(p.dtype)
                  for i, p in enumerate(self.params)]
        # a probe (version 0) hears the claim; a confirmation of another source's version hears that version
        # with the forged digest, so that it never confirms an honest source
        version = asked if not full and type(asked) is int and asked > 0 else claimed
        body: dict = {"version": version, "digest": digest(b"".join(t.numpy().tobytes() for t in forged))}
        if full:
            body["params"] = forged
            state = self.optimizer.state_dict()["state"]
            body["state"] = {str(i): dict(v) for i, v in state.items()}
        self.log({"kind": "attack", "peer": self.me, "stage": self.stage, "link": None, "direction": WEIGHTS,
                  "it": self.version, "tampered": True, "attack": self.attack.name, "to": sender, "claimed": version,
                  "full": full})
        return encode(body)

    def tamper(self, kind: str, it: int, key: m.Key, tensor: torch.Tensor) -> torch.Tensor:
        link = self.stage if kind == ACTIVATION else self.stage - 1
        probe = None if self.probe is None else (lambda t: self.probe(kind, link, t, key))
        sent = self.attack.relay(LinkView(kind, it, key, tensor, probe))
        self.log({"kind": "attack", "peer": self.me, "stage": self.stage, "link": link,
                  "direction": "forward" if kind == ACTIVATION else "backward", "mb": m.key_name(key),
                  "src": key[0], "seq": key[1], "att": key[2], "it": it, "tampered": sent.tampered,
                  "attack": sent.attack})
        return sent.tensor.detach().to(torch.float32).contiguous()

    def contribute(self, it: int, vector: torch.Tensor) -> torch.Tensor:
        """Its part of the stage all-reduce, through the policy (only target `aggregation` tampers it)."""
        sent = self.attack.relay(LinkView(AGGREGATION, it, ("aggregate", it), vector))
        if sent.tampered:  # one record per lie (link attacks log every tensor; SENTINEL scores those per microbatch)
            self.log({"kind": "attack", "peer": self.me, "stage": self.stage, "link": None, "direction": AGGREGATION,
                      "it": it, "tampered": True, "attack": sent.attack})
        return sent.tensor.detach().to(torch.float32).reshape(-1).contiguous()

    def signed(self, direction: str, out: m.Carry, received: m.Carry, to: str) -> m.Carry:
        carry = super().signed(direction, out, received, to)
        if direction != "forward" or not getattr(self.attack, "frames", False) or self.stage < 2:
            return carry
        if not self.attack.active(LinkView(ACTIVATION, carry.it, carry.key, carry.tensor)):
            return carry
        victim = self.attack.victim([p for p, s in self.directory.items() if s == self.stage - 1])
        if victim is None:
            return carry
        path = carry.path[:self.stage - 1] + (victim,) + carry.path[self.stage:]
        hops = tuple(dataclasses.replace(h, sender=victim) if h.link == self.stage - 1 and h.sender else h
                     for h in carry.hops)
        return dataclasses.replace(carry, path=path, hops=hops)
