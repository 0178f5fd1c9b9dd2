"""A data-parallel replica's state on the wire: the canonical snapshot (model, optimizer, step, ban ledger)
that catch-up serves and checkpoints store, and the digests of the updates a replica applies.

Honest replicas hold bit-identical states, so the bytes and digests here agree between them.
"""

from __future__ import annotations

import torch

from ...algorithms.btard.bans import BanRecord
from ...core.errors import Evidence, RemoteError
from ...core.serialization import decode, digest, encode, tensor_bytes
from ...training.task import set_flat_grad
from .peer import DataParallelPeer


def state_bytes(peer: DataParallelPeer, step: int) -> bytes:
    """The replica's state, ready to train `step`, in canonical bytes (equal on equal replicas)."""
    optimizer = peer.optimizer.state_dict()["state"]
    params = list(peer.model.parameters())
    return encode(
        {
            "step": step,
            "model": {name: t.detach() for name, t in peer.model.state_dict().items()},
            "optimizer": [_entry(optimizer.get(i, {})) for i in range(len(params))],
            "bans": [[r.step, r.peer, r.reason, r.accuser] for r in peer.ledger.records],
        }
    )


def _entry(state: dict) -> dict:
    return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def load_state(peer: DataParallelPeer, data: bytes, sender: str) -> int:
    """Load a state from `sender` into `peer` (in place); return its step. RemoteError if malformed."""

    def bad(detail: str) -> RemoteError:
        return RemoteError(Evidence(sender, "bad_state", detail))

    obj = decode(data, sender, peer.transport.limits)
    if not isinstance(obj, dict) or set(obj) != {"step", "model", "optimizer", "bans"}:
        raise bad("state must hold exactly step, model, optimizer, bans")
    step, model, optimizer, bans = obj["step"], obj["model"], obj["optimizer"], obj["bans"]
    if type(step) is not int or step < 0:
        raise bad("state step is not a step number")
    own = peer.model.state_dict()
    if not isinstance(model, dict) or set(model) != set(own):
        raise bad("model tensors do not match this task's model")
    for name, tensor in model.items():
        if not isinstance(tensor, torch.Tensor) or tensor.shape != own[name].shape or tensor.dtype != own[name].dtype:
            raise bad(f"model tensor {name} has the wrong type, shape or dtype")
        if not bool(torch.isfinite(tensor).all()):
            raise bad(f"model tensor {name} holds NaN or Inf")
    params = list(peer.model.parameters())
    if not isinstance(optimizer, list) or len(optimizer) != len(params):
        raise bad("optimizer state does not match the model's parameters")
    for entry, param in zip(optimizer, params):
        if not isinstance(entry, dict):
            raise bad("optimizer entry is not a mapping")
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise bad("optimizer tensor of the wrong shape")
    if not isinstance(bans, list) or not all(
        isinstance(b, list) and len(b) == 4 and type(b[0]) is int and all(isinstance(x, str) for x in b[1:]) for b in bans
    ):
        raise bad("ban records malformed")
    peer.model.load_state_dict({k: v.clone() for k, v in model.items()})
    full = peer.optimizer.state_dict()
    full["state"] = {
        i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
        for i, entry in enumerate(optimizer)
        if entry
    }
    try:
        peer.optimizer.load_state_dict(full)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise bad(f"optimizer state does not load: {exc}") from None
    peer.ledger.restore([BanRecord(*b) for b in bans])
    peer.step = step
    return step


def apply_update(peer: DataParallelPeer, vector: torch.Tensor) -> None:
    """Apply one step's aggregated update exactly as training does."""
    set_flat_grad(peer.model, vector)
    peer.optimizer.step()
    peer.step += 1


def update_digest(vector: torch.Tensor, bans: list[list] = ()) -> bytes:
    """The digest of one step's applied update and the bans that took effect in that step: a
    joiner that replays updates across a ban takes the ban too (the votes on updates cover both)."""
    return digest(tensor_bytes(vector) + (encode(list(bans)) if bans else b""))
