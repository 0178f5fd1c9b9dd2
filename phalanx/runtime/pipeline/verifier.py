"""SENTINEL's verifier role in the pipeline: one code, two placements.

A `VerifierHop` sits on the path of pipeline traffic. Every activation a
stage sends forward and every activation gradient it sends back reaches the
hop wrapped in a VIA request (`to` = the intended receiver); the hop judges
the tensor with `algorithms.sentinel.statistics.Sentinel`, delivers what the verdict
says to pass on (unchanged forward, or the activation momentum with
`forward_response=substitute`; the gradient momentum for a flagged or tainted
gradient), and returns the receiver's answer word to the sender.

* `placement=boundary`: the organiser deploys one trusted `VerifierNode` per
  stage boundary (link s sits between stage s and s+1; link 0 starts at the
  data nodes, link S ends at them). Every FORWARD/BACKWARD crossing link s
  goes through verifier s. Verifiers are not relays and are not in the stage
  directory; nodes know them from the run's configuration.
* `placement=data_node` (client-routed, SWARM's figure 2): relays send their
  outputs and input gradients to the microbatch's data node, which verifies
  them, chooses the next-stage peer itself (`to` empty) and delivers. What
  comes straight to the data node (the last stage's output, stage 1's input
  gradient) is verified in place.

Tensors sent by a data node are trusted (they are not judged). When a
verdict bans workers, the hop broadcasts BAN (peer, iteration, the keys of
the microbatches of that iteration it saw pass through the peer) to every
member: nodes drop the peer from routing (SWARM and GWTF alike) and from
aggregation groups, and data nodes restart those microbatches (SWARM's
restart, the crash path), so they are rerouted around the banned peer.
Upstream blame across separate boundary verifiers uses the path the carry
claims (see `Sentinel.check_forward`'s `upstream`): a relay could put a
peer into a path it forwards to frame it, a limitation noted in the docs.

`hop=off_path` (boundary placement only): the verifier leaves the data path.
A sender sends its carry straight to the receiver and, first, a COPY of it
(the tensor with the sender's signed hop record) to the link's verifier;
the receiver sends the verifier a RECEIPT (the sender's signed record that
came with what it received). The verifier judges the copy as it would have
judged the VIA request (same statistics, taint, bind sketches, bans), and
tells the microbatch's data node its VERDICT per link and direction. A
tensor is cleared when its copy passed and (for a relay receiver) the
receipt names the same digest (a data node sends receipts too). Slots are
per sender and receiver, the first copy and the first receipt of a slot
count, and a verdict names its sender: a peer off a microbatch's path can
neither clear nor flag it. Two signed records of one hop with different
digests are the sender's equivocation: banned at once. A receipt with no
copy (within `verdict_timeout`) is the sender's omission (`no_copy`, a
flag against it: a sender sends its copy before the tensor). A receiver cannot
withhold its receipts: its own copy of what it sends on carries the record
signed to it, which that link's verifier passes on as its receipt. Nothing is
substituted: a flagged gradient (or activation) has its microbatch left out
of the aggregation by its data node, which aggregates only microbatches
whose every relay-sent tensor was cleared (a verdict missing after
`verdict_timeout`: not cleared, deferred to the next iteration), so no
stage aggregates a gradient computed from a flagged tensor. Judging waits
(at most `verdict_timeout`) for the bind sketch of the sender's input, which
the upstream verifier sends beside, not ahead of, the tensor; a copy whose
input sketch never comes is never judged, so never cleared (deferred).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...algorithms.sentinel.statistics import (
    BACKWARD,
    FORWARD,
    Sentinel,
    SentinelConfig,
    Verdict,
)
from ...core.errors import ConfigError, Evidence, PhalanxError, RemoteError
from ...core.serialization import encode
from ...transport.base import Transport
from . import messages as m
from .config import PipelineConfig

VIA = "pp.via"  # request, sender -> verifier hop: {"dir", "to", "carry"}; answered with the receiver's word
BAN = "pp.ban"  # one-way, verifier -> every member: {"peer", "it", "keys"}
TAINT = "pp.taint"  # one-way, boundary verifier -> the other verifiers: a microbatch flagged forward / substituted back
COPY = "pp.copy"  # one-way, sender -> link verifier (hop=off_path): {"dir", "to", "carry"}, as VIA
RECEIPT = "pp.receipt"  # one-way, receiver -> link verifier (hop=off_path): {"hop"}, the sender's record it got
VERDICT = "pp.verdict"  # one-way, link verifier -> data node (hop=off_path): {"key", "it", "dir", "link", "sender", "to", "ok"}
PLACEMENTS = ("boundary", "data_node")
HOPS = ("inline", "off_path")
FORWARD_RESPONSES = ("pass", "substitute")


@dataclass(frozen=True)
class VerifierConfig(SentinelConfig):
    """`sentinel.*` of a pipeline run: whether and where SENTINEL verifies, and its statistics' parameters.

    `forward_response`: `pass` forwards a flagged activation unchanged (the
    paper's figure 5); `substitute` sends the link's activation momentum (the
    EMA per-feature mean broadcast to the tensor's shape) instead.
    `verifier_flops`: speed of a boundary verifier's machine (FLOP/s) in the
    simulator; the verification cost charged per tensor is an estimate of the
    projection and quantile work, 2*N*C*P + 5*N*P*log2(N) for N token vectors of
    C features and P projections.
    """

    enabled: bool = False
    placement: str = "boundary"  # boundary | data_node
    forward_response: str = "pass"  # pass | substitute
    verifier_flops: float = 50e9
    signed_hops: bool = True  # boundary placement: blame upstream only along verifiers' signed hop records
    hop: str = "inline"  # boundary placement: inline (traffic goes through the verifier) | off_path (a copy does)
    verdict_timeout: float = 1.0  # off_path: how long a data node waits for its microbatches' verdicts before BEGIN

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.enabled, bool) or not isinstance(self.signed_hops, bool):
            raise ConfigError(f"sentinel.enabled={self.enabled!r} and sentinel.signed_hops={self.signed_hops!r} "
                              "must be true or false")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"sentinel.placement={self.placement!r} must be one of {', '.join(PLACEMENTS)}")
        if self.forward_response not in FORWARD_RESPONSES:
            raise ConfigError(
                f"sentinel.forward_response={self.forward_response!r} must be one of {', '.join(FORWARD_RESPONSES)}")
        if not (math.isfinite(self.verifier_flops) and self.verifier_flops > 0):
            raise ConfigError(f"sentinel.verifier_flops={self.verifier_flops!r} must be a finite number > 0")
        if self.hop not in HOPS:
            raise ConfigError(f"sentinel.hop={self.hop!r} must be one of {', '.join(HOPS)}")
        if self.hop == "off_path" and (self.placement != "boundary" or self.forward_response != "pass"):
            raise ConfigError("sentinel.hop=off_path needs sentinel.placement=boundary and sentinel.forward_response=pass "
                              "(off the path nothing can be substituted); use sentinel.hop=inline")
        if not (isinstance(self.verdict_timeout, (int, float)) and math.isfinite(self.verdict_timeout)
                and self.verdict_timeout > 0):
            raise ConfigError(f"sentinel.verdict_timeout={self.verdict_timeout!r} must be a finite number of seconds > 0")

    @property
    def off_path(self) -> bool:
        return self.enabled and self.placement == "boundary" and self.hop == "off_path"

    def statistics(self, seed: int) -> SentinelConfig:
        """The `Sentinel` parameters, with the projection streams seeded by the run."""
        names = {f.name for f in dataclasses.fields(SentinelConfig)}
        return SentinelConfig(**{**{k: v for k, v in dataclasses.asdict(self).items() if k in names}, "seed": seed})


def link_of(direction: str, c: m.Carry) -> int:
    """The link a carry crosses: forward into stage s crosses link s-1; the gradient of stage s's output, link s."""
    return c.stage - 1 if direction == FORWARD else c.stage


def sender_of(direction: str, c: m.Carry, last: int) -> str:
    """Who sent a carry over its link, as the path says."""
    if direction == FORWARD:
        return c.path[-1]
    return c.path[c.stage + 1] if c.stage < last else c.path[0]


def chained_upstream(c: m.Carry) -> tuple[dict[int, str] | None, str]:
    """Off the path, a forward carry over link l: the record of every earlier link must be signed by the path's
    sender over it and chain to the next one (addressed to the next signer, handing on what that one says it
    received), so the path names only peers that signed for it. (stage -> sender for links 1..l-1, problem)."""
    records = {h.link: h for h in c.hops
               if h.key == c.key and h.it == c.it and h.direction == FORWARD and h.valid()}
    upstream = {}
    for earlier in range(link_of(FORWARD, c)):
        record, following = records.get(earlier), records.get(earlier + 1)
        if (record is None or following is None or record.signer != c.path[earlier]
                or record.to != following.signer or record.sent != following.received):
            return None, "forged_hop"
        if earlier >= 1:
            upstream[earlier] = record.signer
    return upstream, ""


def via_bytes(direction: str, to: str, c: m.Carry) -> bytes:
    return encode({"dir": direction, "to": to, "carry": c.to_bytes()})


def verify_flops(tensor: torch.Tensor, projections: int) -> float:
    rows = tensor.numel() // max(1, tensor.shape[-1])
    return 2.0 * tensor.numel() * projections + 5.0 * rows * projections * math.log2(max(2, rows))


EventSink = Callable[[dict], None]
Chooser = Callable[[m.Carry, set[str]], str | None]


class VerifierHop:
    """The verifier role on one transport: judges carries, delivers them, broadcasts bans.

    `trusted(peer)` says whether a sender is a data node (its tensors are not
    judged). `choose(carry, excluded)` picks the receiver when a VIA request
    leaves `to` empty (client-routed mode); None: nobody can take it.
    `on_ban(peer, it, keys)` applies the hop's own bans where it runs.
    """

    def __init__(
        self, transport: Transport, config: VerifierConfig, pipeline: PipelineConfig, seed: int,
        trusted: Callable[[str], bool], on_event: EventSink, choose: Chooser | None = None,
        on_ban: Callable[[str, int, list[m.Key]], None] | None = None,
    ) -> None:
        self.transport = transport
        self.me = transport.peer_id
        self.config = config
        self.pipeline = pipeline
        self.last = pipeline.stages
        self.sentinel = Sentinel(config.statistics(seed))
        self.trusted = trusted
        self.on_event = on_event
        self.choose = choose
        self.peers: list[str] = []  # the other verifiers of the run (boundary placement): taint is shared with them
        self.links: dict[int, str] = {}  # boundary placement: link -> its verifier (input sketches go there)
        self.on_ban = on_ban or (lambda peer, it, keys: None)
        self.seen: dict[m.Key, tuple[int, set[str]]] = {}  # microbatch -> (iteration, nodes it passed)
        self.dropped: dict[m.Key, int] = {}  # microbatch attempts being rerouted -> iteration: their traffic is refused
        self.iteration = 0
        self._tasks: set[asyncio.Task] = set()
        # hop=off_path, by slot (key, it, direction, link, sender, receiver): the copy (digest, passed, carry) once
        # judged (None while it waits or when it is not judged: a slot here is one a copy came for), the digest the
        # receipt names; input sketches arrived (key, stage, direction) -> (iteration, sketch), and their waiters
        self.copies: dict[tuple, tuple[bytes, bool, m.Carry | None] | None] = {}
        self.receipts: dict[tuple, bytes] = {}
        self.early: dict[tuple, m.Carry] = {}  # backward copies that came before the forward copy to their sender
        self.inputs: dict[tuple, tuple[int, torch.Tensor]] = {}
        self._input_waits: dict[tuple, asyncio.Event] = {}
        transport.add_request_handler(VIA, self._on_via)
        if config.off_path:
            transport.add_message_handler(COPY, self._on_copy)
            transport.add_message_handler(RECEIPT, self._on_receipt)

    # --- judging --------------------------------------------------------------

    def judge(self, direction: str, c: m.Carry, receiver: str) -> torch.Tensor | None:
        """The tensor to pass on for carry `c`, or None to refuse it (the attempt is being rerouted, or
        its sender is banned: then it is rerouted)."""
        if c.key in self.dropped:
            return None
        self._remember(c, receiver)
        sender = sender_of(direction, c, self.last)
        passed = c.tensor if self.trusted(sender) else self._judged(direction, c, sender, receiver)
        if passed is not None and self.sentinel.binds:
            self._bind_input(direction, c, passed)
        return passed

    def _bind_input(self, direction: str, c: m.Carry, passed: torch.Tensor) -> None:
        """Record what is delivered to the next stage (forward) or the previous one (backward), so that the
        stage's own output for this microbatch is bound to it (`sentinel.bind`); boundary verifiers pass the
        sketch to the verifier of that stage's outgoing link."""
        link = link_of(direction, c)
        stage, out_link = (link + 1, link + 1) if direction == FORWARD else (link, link - 1)
        if not 1 <= stage <= self.last or out_link < 0:
            return
        sketch = self.sentinel.sketch(passed)
        peer = self.links.get(out_link)
        if not self.links or peer == self.me:
            self.sentinel.record_input(c.key, stage, direction, sketch)
        elif peer is not None:
            body = encode({"input": [stage, direction, sketch], "key": list(c.key), **self._iteration_note(c.it)})
            self.spawn(self.transport.send(peer, TAINT, body))

    def _judged(self, direction: str, c: m.Carry, sender: str, receiver: str) -> torch.Tensor | None:
        verdict = self._assess(direction, c, sender, receiver)
        if verdict is None:
            return None
        if direction == FORWARD and verdict.flagged and self.config.forward_response == "substitute":
            return self.sentinel.momentum(verdict.link, c.tensor, FORWARD)
        return verdict.passed_on(c.tensor)

    def _assess(self, direction: str, c: m.Carry, sender: str, receiver: str) -> Verdict | None:
        """Judge a relay's carry (hop records, statistics, taint shared with the other verifiers); None: its
        sender is banned (the microbatch is rerouted)."""
        link = link_of(direction, c)
        signed = self.signs
        upstream, problem = self._signed_upstream(direction, c, sender, receiver) if signed else (None, "")
        if problem:
            tainted = self.sentinel.taint_of(c.key)
            # off the path a forward copy can come from a peer off the microbatch's path, whose taint would keep the
            # microbatch out of the aggregation (review RS s25 2): it taints once a receipt pairs it (`_pair`)
            verdict = self.sentinel.reject(link, direction, sender, c.key, problem, c.tensor,
                                           taint=not (self.config.off_path and direction == FORWARD))
            if direction == FORWARD and tainted is None and self.sentinel.taint_of(c.key) is not None:
                self._share({"tainted": [link, sender]}, c.key, c.it)
            elif verdict.substitute is not None:
                self._share({"replaced": link}, c.key, c.it)
        elif direction == FORWARD:
            if not signed:  # the path the carry claims (a relay can write anyone into it)
                upstream = {s: c.path[s] for s in range(1, len(c.path) - 1)}
            tainted = self.sentinel.taint_of(c.key)
            verdict = self.sentinel.check_forward(link, sender, c.key, c.tensor, upstream=upstream)
            if tainted is None and self.sentinel.taint_of(c.key) is not None:
                self._share({"tainted": [link, sender]}, c.key, c.it)
        else:
            if not signed:
                upstream = {s: c.path[s] for s in range(1, c.stage + 1)}
            verdict = self.sentinel.check_backward(link, sender, c.key, c.tensor, upstream=upstream)
            if verdict.substitute is not None:
                self._share({"replaced": link}, c.key, c.it)
        self._record(verdict, c)
        if verdict.reason == "banned":
            self.spawn(self.reroute(sender, c))
            return None
        return verdict

    @property
    def signs(self) -> bool:
        """Boundary verifiers with `signed_hops`: hops sign what they pass on, and blame follows signatures."""
        return bool(self.links) and self.config.signed_hops

    def _signed_upstream(self, direction: str, c: m.Carry, sender: str, receiver: str) -> tuple[dict[int, str] | None, str]:
        """Who sent this microbatch forward over earlier links, as the earlier verifiers signed it, and what is
        wrong with the hop records the sender forwarded ("" if nothing). The sender's own record must be
        signed by it and match the tensor and receiver; the verifier record before it must name the sender as
        its receiver and hand on what the sender says it received; forward, every earlier link's verifier
        record must be there. Backward, upstream senders are those this verifier saw forward (None)."""
        link = link_of(direction, c)
        hops = c.hops
        own = hops[-1] if hops else None
        if own is None or own.signer != sender or not self._matches(own, direction, c, link) or not own.valid():
            return None, "unsigned"
        if own.sent != m.tensor_digest(c.tensor) or (direction == FORWARD and receiver and own.to != receiver):
            return None, "forged_hop"
        if self.config.off_path:
            return (None, "") if direction == BACKWARD else chained_upstream(c)  # backward: senders seen forward
        before = self.links.get(link - 1 if direction == FORWARD else link + 1)
        prev = hops[-2] if len(hops) >= 2 else None
        if before is not None and (prev is None or prev.signer != before or prev.to != sender
                                   or prev.sent != own.received or not self._verified(prev, direction, c)):
            return None, "forged_hop"
        if direction == BACKWARD:
            return None, ""
        upstream = {}
        for earlier in range(1, link):
            record = next((h for h in hops if h.signer == self.links.get(earlier) and h.link == earlier), None)
            if record is None or not self._verified(record, direction, c):
                return None, "forged_hop"
            upstream[earlier] = record.sender
        return upstream, ""

    @staticmethod
    def _matches(hop: m.Hop, direction: str, c: m.Carry, link: int) -> bool:
        return hop.key == c.key and hop.it == c.it and hop.direction == direction and hop.link == link

    def _verified(self, hop: m.Hop, direction: str, c: m.Carry) -> bool:
        """A verifier's record of this microbatch attempt and direction, with a valid signature."""
        return hop.key == c.key and hop.it == c.it and hop.direction == direction and hop.valid()

    def signed_on(self, direction: str, c: m.Carry, sender: str, receiver: str, passed: torch.Tensor) -> m.Carry:
        """The carry to deliver: the tensor passed on, with this verifier's signed hop record appended.
        A substitute goes on under this verifier's seal (the sender's seal covers only what it sent)."""
        if c.seal is not None and passed is not c.tensor:
            c = dataclasses.replace(c, seal=m.Seal.make(self.transport.identity, c.key, c.it, direction, c.stage, passed))
        if not self.signs:
            return dataclasses.replace(c, tensor=passed)
        hop = m.Hop.signed(self.transport.identity, c.key, c.it, direction, link_of(direction, c), sender,
                           m.tensor_digest(c.tensor), m.tensor_digest(passed), receiver)
        return dataclasses.replace(c, tensor=passed, hops=c.hops + (hop,))

    def _share(self, note: dict, key: m.Key, it: int) -> None:
        """Tell the other verifiers (they judge the microbatch's other links) what this one did to it."""
        body = encode({**note, "key": list(key), **self._iteration_note(it)})
        for peer in self.peers:
            self.spawn(self.transport.send(peer, TAINT, body))

    def _iteration_note(self, it: int) -> dict:
        """Off the path notes name their iteration: a deferred microbatch comes again under the same key, and
        a verifier must not judge its new tensors against what it remembers of the old ones."""
        return {"it": it} if self.config.off_path else {}

    def on_taint(self, sender: str, payload: bytes) -> None:
        obj = m.parse_mapping(payload, sender, self.transport.limits, "taint note")
        key = m.parse_key(dict(zip(("src", "seq", "att"), obj.get("key") or [])), sender)
        tainted, replaced, bound = obj.get("tainted"), obj.get("replaced"), obj.get("input")
        it = obj.get("it")
        if self.config.off_path and type(it) is int and key in self.seen and self.seen[key][0] < it:
            self._renew(key, it)
        if isinstance(bound, list) and len(bound) == 3 and type(bound[0]) is int and bound[1] in (FORWARD, BACKWARD) \
                and isinstance(bound[2], torch.Tensor) and bound[2].dim() == 2 and bound[2].is_floating_point():
            self.sentinel.record_input(key, bound[0], bound[1], bound[2].float())
            if type(it) is int:
                self._input_arrived((key, bound[0], bound[1]), it, bound[2].float())
        elif isinstance(tainted, list) and len(tainted) == 2 and type(tainted[0]) is int and isinstance(tainted[1], str):
            self.sentinel.mark_tainted(key, tainted[0], tainted[1])
        elif type(replaced) is int:
            self.sentinel.mark_replaced(key, replaced)
        else:
            raise RemoteError(Evidence(sender, "malformed", "bad taint note"))

    def cost(self, tensor: torch.Tensor) -> float:
        return verify_flops(tensor, self.config.projections)

    def _remember(self, c: m.Carry, receiver: str) -> None:
        if c.it > self.iteration:
            self.iteration = c.it
            for key in [k for k, (it, _) in self.seen.items() if it < c.it - 1]:
                self.forget(key)
            for key in [k for k, it in self.dropped.items() if it < c.it - 1]:
                del self.dropped[key]
            for table in (self.copies, self.receipts, self.early):
                for slot in [k for k in table if k[1] < c.it - 1]:
                    del table[slot]
            self.inputs = {k: v for k, v in self.inputs.items() if v[0] >= c.it - 1}
        it, nodes = self.seen.setdefault(c.key, (c.it, set()))
        nodes.update(p for p in c.path if not self.trusted(p))
        if receiver and not self.trusted(receiver):
            nodes.add(receiver)

    def forget(self, key: m.Key) -> None:
        """A microbatch attempt that will not come back (restarted, deferred)."""
        self.seen.pop(key, None)
        self.sentinel.forget(key)

    def drop(self, key: m.Key, it: int) -> None:
        """A microbatch attempt its data node restarts around a banned peer: refuse the rest of its traffic
        (stragglers still computed from a tampered tensor would otherwise be judged against honest peers)."""
        self.dropped[key] = it
        self.forget(key)

    def _record(self, verdict: Verdict, c: m.Carry) -> None:
        self.on_event({
            "kind": "verdict", "by": self.me, "peer": verdict.worker, "link": verdict.link,
            "direction": verdict.direction, "mb": m.key_name(c.key), "src": c.key[0], "seq": c.key[1],
            "att": c.key[2], "it": c.it, "flagged": verdict.flagged, "reason": verdict.reason,
            "substituted": verdict.substitute is not None and not self.config.off_path, "outside": list(verdict.outside),
            "distances": dict(verdict.distances), "convicted": list(verdict.convicted),
            "suspects": list(verdict.suspects), "t": self.transport.clock.now(),
        })
        for held in verdict.settled:  # a gradient judged before this activation, struck now (review RS s25 5)
            self.on_event({"kind": "settled", "by": self.me, "peer": held.worker, "link": held.link,
                           "direction": held.direction, "mb": m.key_name(c.key), "it": c.it, "flagged": held.flagged,
                           "outside": list(held.outside), "convicted": list(held.convicted),
                           "suspects": list(held.suspects), "t": self.transport.clock.now()})
        for peer in verdict.bans:
            self.spawn(self.announce(peer, c.it, verdict.link))

    # --- bans ---------------------------------------------------------------------

    async def announce(self, peer: str, it: int, link: int) -> None:
        """Record a ban and tell every member, with the microbatches of the iteration it touched."""
        keys = sorted(k for k, (kit, nodes) in self.seen.items() if kit >= it and peer in nodes)
        self.on_event({"kind": "ban", "peer": peer, "step": it, "reason": "sentinel", "by": self.me, "link": link,
                       "t": self.transport.clock.now(), "microbatches": len(keys)})
        for key in keys:
            self.drop(key, it)
        self.on_ban(peer, it, keys)
        body = encode({"peer": peer, "it": it, "keys": [list(k) for k in keys]})
        for member in self.transport.members():
            if member != self.me:
                await self.transport.send(member, BAN, body)

    async def reroute(self, peer: str, c: m.Carry) -> None:
        """A banned peer still sends a microbatch (it got it before the ban reached its sender):
        have its data node restart it."""
        self.drop(c.key, c.it)
        self.on_ban(peer, c.it, [c.key])
        if c.key[0] != self.me:
            await self.transport.send(c.key[0], BAN, encode({"peer": peer, "it": c.it, "keys": [list(c.key)]}))

    def banned_elsewhere(self, peer: str) -> None:
        """Another verifier banned `peer`: refuse its traffic here too."""
        self.sentinel.ban(peer)

    # --- the VIA hop ------------------------------------------------------------------

    def _parse_hop(self, sender: str, payload: bytes, what: str) -> tuple[str, str, m.Carry]:
        """(direction, receiver, carry) of a VIA request or a COPY; evidence against the sender if malformed."""
        obj = m.parse_mapping(payload, sender, self.transport.limits, f"{what} request")
        direction, to, raw = obj.get("dir"), obj.get("to"), obj.get("carry")
        if direction not in (FORWARD, BACKWARD) or not isinstance(to, str) or not isinstance(raw, bytes):
            raise RemoteError(Evidence(sender, "malformed", f"bad {what} request"))
        c = m.parse_carry(raw, sender, self.transport.limits, self.last + 1)
        if (direction == FORWARD and (len(c.path) != c.stage or c.stage < 1)) or (
                direction == BACKWARD and (len(c.path) != self.last + 1 or c.stage > self.last)):
            raise RemoteError(Evidence(sender, "malformed", f"{what} carry with an inconsistent path", c.it))
        if sender_of(direction, c, self.last) != sender:
            raise RemoteError(Evidence(sender, "false_stage", f"{what} carry sent by a peer not at its place in the path", c.it))
        if direction == BACKWARD:
            to = c.path[c.stage]
        elif c.stage == self.last + 1:
            to = c.key[0]
        return direction, to, c

    async def _on_via(self, sender: str, payload: bytes) -> bytes:
        direction, to, c = self._parse_hop(sender, payload, "via")
        tensor = self.judge(direction, c, to)
        if tensor is None:
            return m.answer(m.STALE if c.key in self.dropped else m.DENIED)
        await self.transport.charge_compute(self.cost(c.tensor))
        c = self.signed_on(direction, c, sender, to, tensor)
        topic = m.FORWARD if direction == FORWARD else m.BACKWARD
        if to:
            return m.answer(await self.deliver(to, topic, c))
        return m.answer(await self.route(c))

    # --- off the path (hop=off_path): copies, receipts, verdicts --------------------------------------

    def _on_copy(self, sender: str, payload: bytes) -> None:
        """A sender's copy of a carry it sends straight to its receiver: judge it and tell the data node. The
        first copy of a slot counts (a resend repeats it). A backward copy is judged only from a peer this
        verifier saw the microbatch sent to forward over the link: nobody else holds it, and judging it would
        teach the fences tensors of peers off the path. One that comes before that forward copy waits for it
        (`early`): else a sender that holds its forward copy back (within `verdict_timeout` of its receiver's
        receipt) would keep its receiver's gradient of that microbatch from ever being judged, a colluding
        gradient liar from ever being struck."""
        direction, to, c = self._parse_hop(sender, payload, "copy")
        slot = (c.key, c.it, direction, link_of(direction, c), sender, to)
        if not self.trusted(sender) and slot[3] == (0 if direction == FORWARD else self.last):
            # only a data node sends over link 0 forward and link S backward; a relay's copy there was remembered
            # before any check (review RS s25 6: one at a far-future iteration moved this verifier past every real
            # copy and receipt, and no microbatch was cleared again)
            raise RemoteError(Evidence(sender, "false_stage", "a copy of what only a data node sends", c.it))
        if slot in self.copies or c.it < self.iteration - 1:
            return
        self.copies[slot] = None  # it came (a receipt without it is the sender's omission)
        if direction == BACKWARD and not self.trusted(sender) and not any(
                s[:4] == (c.key, c.it, FORWARD, slot[3]) and s[5] == sender for s in self.copies):
            self._keep_early(slot, c)
            return
        self._receipt_in_chain(direction, c, sender)
        self.spawn(self._judge_copy(slot, c))
        if direction == FORWARD:
            for waiting in [s for s in self.early if s[:2] == slot[:2] and s[3:5] == (slot[3], to)]:
                early = self.early.pop(waiting)
                self._receipt_in_chain(BACKWARD, early, to)
                self.spawn(self._judge_copy(waiting, early))

    def _keep_early(self, slot: tuple, c: m.Carry) -> None:
        """Keep a backward copy until the forward copy to its sender comes: one of this or the next iteration, from a
        peer not banned, at most two iterations of a relay's `capacity` per sender (else dropped unjudged, as a copy
        of a microbatch it does not hold: review RS s25 4, a relay filled the verifier's memory with copies of
        microbatches that do not exist, at a far-future iteration)."""
        sender = slot[4]
        if (c.it > self.iteration + 1 or sender in self.sentinel.banned()
                or sum(s[4] == sender for s in self.early) >= 2 * self.pipeline.capacity):
            return
        self.early[slot] = c

    def _receipt_in_chain(self, direction: str, c: m.Carry, sender: str) -> None:
        """The record the previous link's sender signed to this copy's sender travels with the copy: pass it to
        that link's verifier as a receipt, so that a relay gains nothing by withholding its own receipts."""
        before = link_of(direction, c) + (-1 if direction == FORWARD else 1)
        peer = self.links.get(before)
        record = next((h for h in c.hops if h.link == before and h.to == sender and h.key == c.key and h.it == c.it
                       and h.direction == direction), None)
        if peer is None or record is None or not record.valid():
            return
        if peer == self.me:
            self._take_receipt(record)
        else:
            self.spawn(self.transport.send(peer, RECEIPT, encode({"hop": record.to_obj()})))

    async def _judge_copy(self, slot: tuple, c: m.Carry) -> None:
        key, it, direction, link, sender, to = slot
        trusted = self.trusted(sender)
        if not trusted and self.sentinel.binds and not await self._await_input(direction, c):
            return  # never judged without what the sender was given: not cleared, its data node defers it
        await self.transport.charge_compute(self.cost(c.tensor))
        if self.dropped.get(key, -1) >= it:
            return
        if key in self.seen and self.seen[key][0] < it:
            self._renew(key, it)
        self._remember(c, to)
        if trusted:
            if self.sentinel.binds:
                self._bind_input(direction, c, c.tensor)  # a data node's tensor is not judged
            return
        verdict = self._assess(direction, c, sender, to)
        if verdict is None:
            return  # its sender is banned: the microbatch is rerouted
        sent = m.tensor_digest(c.tensor)
        passed = not verdict.flagged and verdict.substitute is None
        # a tensor whose hop records failed is nobody's input: its sketch is not passed on at `_pair` (review RS s25
        # 7: a forged copy paired by a colluder's receipt replaced the real input's sketch, and the honest relay that
        # held the microbatch was flagged on ``bind``, alone)
        self.copies[slot] = (sent, passed, None if verdict.reason in ("unsigned", "forged_hop") else c)
        if not passed:
            self._tell(slot, False)
        if slot in self.receipts:
            self._pair(slot)

    def _on_receipt(self, sender: str, payload: bytes) -> None:
        """A receiver (or the verifier that found it in the receiver's own copy) forwards the sender's signed
        record of what the receiver got: it must name the digest of the copy this verifier judged."""
        obj = m.parse_mapping(payload, sender, self.transport.limits, "receipt")
        hop = m.parse_hop(obj.get("hop"), sender)
        if not hop.valid() or (hop.to != sender and sender not in self.peers):
            raise RemoteError(Evidence(sender, "forged_hop", "a receipt with a record not signed to it", hop.it))
        self._take_receipt(hop)

    def _take_receipt(self, hop: m.Hop) -> None:
        slot = (hop.key, hop.it, hop.direction, hop.link, hop.signer, hop.to)
        if hop.it < self.iteration - 1 or slot in self.receipts:
            return
        self.receipts[slot] = hop.sent
        if slot not in self.copies:
            self.spawn(self._expect_copy(slot))
        elif self.copies[slot] is not None:
            self._pair(slot)

    async def _expect_copy(self, slot: tuple) -> None:
        """A receipt is the sender's signed record that it sent the tensor to the receiver (a receiver cannot forge
        it), and an honest sender sends the copy before the tensor: none within `verdict_timeout` is the sender's
        fault (it kept a tensor from its verifier). A flag against it alone (its strikes ban it), and the
        microbatch is flagged and tainted like one whose tensor failed the fences."""
        await asyncio.sleep(self.config.verdict_timeout)
        key, it, direction, link, sender, to = slot
        if slot in self.copies or slot not in self.receipts or self.dropped.get(key, -1) >= it:
            return
        verdict = self.sentinel.reject(link, direction, sender, key, "no_copy", torch.zeros(1, 1))
        self._flag_sender(slot, "no_copy", list(verdict.convicted))
        for peer in verdict.bans:
            self.spawn(self.announce(peer, it, link))

    def _flag_sender(self, slot: tuple, reason: str, convicted: list[str]) -> None:
        """A copy flagged for what its sender did (`no_copy`, `forked_copy`): taint the microbatch for the other
        verifiers, log the verdict, and tell its data node."""
        key, it, direction, link, sender, to = slot
        self._share({"tainted": [link, sender]} if direction == FORWARD else {"replaced": link}, key, it)
        self.on_event({"kind": "verdict", "by": self.me, "peer": sender, "link": link, "direction": direction,
                       "mb": m.key_name(key), "src": key[0], "seq": key[1], "att": key[2], "it": it, "flagged": True,
                       "reason": reason, "substituted": False, "outside": [], "distances": {},
                       "convicted": convicted, "suspects": [sender], "t": self.transport.clock.now()})
        self._tell(slot, False)

    def _pair(self, slot: tuple) -> None:
        """The copy judged and the receipt are in. The same digest: the receiver got what was judged, so the
        tensor is cleared and its sketch goes to the verifier that judges the receiver's own output (not
        before: that one must not judge an output computed from a tensor it cannot know is the one judged).
        Two digests signed by the sender for one hop are its equivocation (it showed the verifier another
        tensor than the receiver): banned at once, the microbatch flagged, tainted for the other verifiers."""
        sent, passed, c = self.copies[slot]
        key, it, direction, link, sender, to = slot
        if self.receipts[slot] == sent:
            if not passed and direction == FORWARD and self.sentinel.taint_of(key) is None:
                self.sentinel.mark_tainted(key, link, sender)  # its receiver got a tensor whose hop records were bad
                self._share({"tainted": [link, sender]}, key, it)
            if self.sentinel.binds and c is not None:
                self._bind_input(direction, c, c.tensor)
            if passed:
                self._tell(slot, True)
            return
        if direction == FORWARD:
            self.sentinel.mark_tainted(key, link, sender)
        else:
            self.sentinel.mark_replaced(key, link)
        self._flag_sender(slot, "forked_copy", [sender])
        if sender not in self.sentinel.banned():
            self.sentinel.ban(sender)
            self.spawn(self.announce(sender, it, link))

    def _tell(self, slot: tuple, passed: bool) -> None:
        key, it, direction, link, sender, to = slot
        body = encode({"src": key[0], "seq": key[1], "att": key[2], "it": it, "dir": direction, "link": link,
                       "sender": sender, "to": to, "ok": passed})
        self.spawn(self.transport.send(key[0], VERDICT, body))

    def _input_arrived(self, slot: tuple, it: int, sketch: torch.Tensor) -> None:
        self.inputs[slot] = (it, sketch)
        event = self._input_waits.pop(slot, None)
        if event is not None:
            event.set()

    def _renew(self, key: m.Key, it: int) -> None:
        """A microbatch its data node deferred comes again under the same key in a later iteration: a new
        computation, not a resend. Forget what was judged of it (its taint, its first tensors: they would make
        the new ones look like equivocation) and keep only the input sketches of the new iteration."""
        self.forget(key)
        for (k, stage, direction), (at, sketch) in self.inputs.items():
            if k == key and at == it:
                self.sentinel.record_input(key, stage, direction, sketch)

    async def _await_input(self, direction: str, c: m.Carry) -> bool:
        """Wait (at most verdict_timeout) for the sketch of what the sender's stage was given, which the previous
        link's verifier sends once it holds that tensor's copy and receipt: it may come after the sender's
        output. False: it did not come, and the output must not be judged (cleared) without it."""
        link = link_of(direction, c)
        stage = link if direction == FORWARD else link + 1
        slot = (c.key, stage, direction)
        if not 1 <= stage <= self.last or self.inputs.get(slot, (-1,))[0] >= c.it or not self.links:
            return True
        event = self._input_waits.setdefault(slot, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), self.config.verdict_timeout)
            return True
        except asyncio.TimeoutError:
            self._input_waits.pop(slot, None)
            return False

    async def deliver(self, to: str, topic: str, c: m.Carry) -> str:
        """Send the judged carry to its receiver; a failure is answered DENIED (the sender tries elsewhere)."""
        try:
            response = await self.transport.request(to, topic, c.to_bytes(), self.pipeline.complete_timeout)
            return m.parse_answer(response, to, self.transport.limits)
        except RemoteError as exc:
            self.transport.report(exc.evidence)
        except PhalanxError:
            pass
        return m.DENIED

    async def route(self, c: m.Carry) -> str:
        """Client-routed forward: choose the next-stage peer, retrying others until one takes it."""
        excluded: set[str] = set()
        deadline = self.transport.clock.now() + 1.5 * self.pipeline.complete_timeout
        while self.choose is not None and self.transport.clock.now() < deadline:
            peer = self.choose(c, excluded)
            if peer is None:
                break
            self._remember(c, peer)
            word = await self.deliver(peer, m.FORWARD, c)
            if word in (m.OK, m.STALE):
                return word
            excluded.add(peer)
        return m.DENIED

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def parse_ban(payload: bytes, sender: str, transport: Transport) -> tuple[str, int, list[m.Key]]:
    obj = m.parse_mapping(payload, sender, transport.limits, "ban")
    peer, it, keys = obj.get("peer"), obj.get("it"), obj.get("keys")
    ok = (isinstance(peer, str) and type(it) is int and isinstance(keys, list) and len(keys) <= 100_000
          and all(isinstance(k, list) and len(k) == 3 and isinstance(k[0], str)
                  and all(type(v) is int and v >= 0 for v in k[1:]) for k in keys))
    if not ok:
        raise RemoteError(Evidence(sender, "malformed", "bad ban message"))
    return peer, it, [(k[0], k[1], k[2]) for k in keys]


class VerifierNode:
    """A trusted boundary verifier (organiser-deployed): a VIA hop for one link, and nothing else."""

    def __init__(self, transport: Transport, config: VerifierConfig, pipeline: PipelineConfig, seed: int,
                 directory: dict[str, int], on_event: EventSink, verifiers: dict[int, str]) -> None:
        self.transport = transport
        self.directory = directory
        self.hop = VerifierHop(transport, config, pipeline, seed, lambda p: self.directory.get(p) == 0, on_event)
        self.verifiers = set(verifiers.values())  # the run's verifiers: their bans and notes are applied here too
        self.hop.peers = sorted(self.verifiers - {transport.peer_id})
        self.hop.links = dict(verifiers)
        self._stopped = asyncio.Event()
        transport.add_message_handler(BAN, self._on_ban)
        transport.add_message_handler(TAINT, self._on_taint)

    def _on_taint(self, sender: str, payload: bytes) -> None:
        if sender in self.verifiers:
            self.hop.on_taint(sender, payload)

    def _on_ban(self, sender: str, payload: bytes) -> None:
        peer, it, keys = parse_ban(payload, sender, self.transport)
        if sender in self.verifiers:
            self.hop.banned_elsewhere(peer)
            for key in keys:
                self.hop.drop(key, it)

    async def serve(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()

    async def close(self) -> None:
        self.stop()
        await self.hop.close()
