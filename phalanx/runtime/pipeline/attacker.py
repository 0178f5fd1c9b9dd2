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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ...algorithms.sentinel.attacks import ACTIVATION, AGGREGATION, LinkAttack, LinkView
from . import messages as m
from .relay import Relay

Probe = Callable[[str, int, torch.Tensor, m.Key], bool]


class AttackingRelay(Relay):
    """A relay whose outgoing tensors are chosen by a link attack policy."""

    def __init__(self, *args, attack: LinkAttack, log: Callable[[dict], None], probe: Probe | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.attack = attack
        self.log = log
        self.probe = probe

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
