"""Canonical encoding of messages that may carry tensors; never pickle.

A message is a tree of None, bool, int, float, str, bytes, lists, dicts with
str keys, and torch tensors. It encodes to one byte string:

    b"PHX1" | u32 header length | header (canonical JSON) | blobs

Tensors and bytes become references into the blob list; a tensor is written as
(dtype, shape, raw little-endian bytes). The same message always encodes to the
same bytes, so its sha256 is a commitment. Decoding a peer's bytes checks every
length, dtype and limit and raises `RemoteError` with the evidence.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .errors import Evidence, RemoteError

MAGIC = b"PHX1"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Limits:
    """Size limits applied to every message a peer receives."""

    max_message_bytes: int = 256 * 2**20
    max_header_bytes: int = 1 * 2**20
    max_tensor_elements: int = 64 * 2**20
    max_blobs: int = 4096
    max_depth: int = 16


DEFAULT_LIMITS = Limits()


def encode(message: Any) -> bytes:
    """Encode a message tree canonically. Raises TypeError on unsupported values."""
    blobs: list[bytes] = []
    header = json.dumps(_to_header(message, blobs), sort_keys=True, separators=(",", ":"), allow_nan=True)
    header_bytes = header.encode()
    parts = [MAGIC, _U32.pack(len(header_bytes)), header_bytes]
    for blob in blobs:
        parts.append(_U64.pack(len(blob)))
        parts.append(blob)
    return b"".join(parts)


def digest(data: bytes) -> bytes:
    """sha256 of bytes: the hash used for commitments and signatures."""
    return hashlib.sha256(data).digest()


def _to_header(value: Any, blobs: list[bytes]) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # JSON has no NaN/Inf; keep them representable and canonical.
        return value if math.isfinite(value) else {"__f": repr(value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        blobs.append(bytes(value))
        return {"__b": len(blobs) - 1}
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPE_NAMES:
            raise TypeError(f"cannot encode tensor of dtype {value.dtype}; allowed: {sorted(DTYPES)}")
        blobs.append(tensor_bytes(value))
        return {"__t": len(blobs) - 1, "dtype": _DTYPE_NAMES[value.dtype], "shape": list(value.shape)}
    if isinstance(value, (list, tuple)):
        return [_to_header(v, blobs) for v in value]
    if isinstance(value, dict):
        out = {}
        for key in value:
            if not isinstance(key, str) or key.startswith("__"):
                raise TypeError(f"message dict keys must be str not starting with '__', got {key!r}")
        for key in sorted(value):  # sorted, so blob order does not depend on insertion order
            out[key] = _to_header(value[key], blobs)
        return out
    raise TypeError(f"cannot encode {type(value).__name__}; encode dataclasses as dicts first")


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (CPU, contiguous)."""
    t = tensor.detach().to("cpu").contiguous()
    if sys.byteorder != "little":
        raise RuntimeError("phalanx's wire format assumes a little-endian host")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def decode(data: bytes, sender: str, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode bytes from `sender`; malformed input raises RemoteError against it."""

    def bad(detail: str, kind: str = "malformed") -> RemoteError:
        return RemoteError(Evidence(sender, kind, detail))

    if len(data) > limits.max_message_bytes:
        raise bad(f"{len(data)} bytes > limit {limits.max_message_bytes}", "oversize")
    if len(data) < 8 or data[:4] != MAGIC:
        raise bad("missing PHX1 magic")
    (header_len,) = _U32.unpack_from(data, 4)
    if header_len > limits.max_header_bytes or 8 + header_len > len(data):
        raise bad(f"header length {header_len} out of range")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]).decode())
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, huge ints, deep nesting
        raise bad(f"header is not acceptable JSON: {type(exc).__name__}") from None
    blobs: list[memoryview] = []
    view = memoryview(data)
    pos = 8 + header_len
    while pos < len(data):
        if len(blobs) >= limits.max_blobs:
            raise bad(f"more than {limits.max_blobs} blobs")
        if pos + 8 > len(data):
            raise bad("truncated blob length")
        (size,) = _U64.unpack_from(data, pos)
        pos += 8
        if pos + size > len(data):
            raise bad("truncated blob")
        blobs.append(view[pos : pos + size])
        pos += size
    used: set[int] = set()
    value = _from_header(header, blobs, used, bad, limits, 0)
    if len(used) != len(blobs):
        raise bad("unreferenced blobs")
    return value


def _from_header(value: Any, blobs: list[memoryview], used: set[int], bad, limits: Limits, depth: int) -> Any:
    if depth > limits.max_depth:
        raise bad(f"nesting deeper than {limits.max_depth}")
    if isinstance(value, list):
        return [_from_header(v, blobs, used, bad, limits, depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    if "__f" in value:
        text = value["__f"]
        if text not in ("nan", "inf", "-inf"):
            raise bad(f"bad float literal {text!r}")
        return float(text)
    if "__b" in value or "__t" in value:
        index = value.get("__b", value.get("__t"))
        if not isinstance(index, int) or not 0 <= index < len(blobs) or index in used:
            raise bad(f"bad blob reference {index!r}")
        used.add(index)
        if "__b" in value:
            return bytes(blobs[index])
        return _tensor_from(value, blobs[index], bad, limits)
    return {k: _from_header(v, blobs, used, bad, limits, depth + 1) for k, v in value.items()}


def _tensor_from(meta: dict, blob: memoryview, bad, limits: Limits) -> torch.Tensor:
    name = meta.get("dtype")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    shape = meta.get("shape")
    if dtype is None:
        raise bad(f"dtype {str(name)[:32]!r} not allowed; allowed: {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > limits.max_depth or not all(type(s) is int and s >= 0 for s in shape):
        raise bad(f"bad shape {str(shape)[:64]}")
    count = math.prod(shape)
    if count > limits.max_tensor_elements or max(shape, default=0) > limits.max_tensor_elements:
        raise bad(f"tensor of {count} elements > {limits.max_tensor_elements}", "oversize")
    itemsize = _ITEMSIZE[name]
    if count * itemsize != len(blob):
        raise bad(f"tensor {meta['dtype']}{shape} needs {count * itemsize} bytes, got {len(blob)}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    raw = bytearray(blob)
    if dtype == torch.bfloat16:
        return torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def check_tensor(
    value: Any,
    sender: str,
    *,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
    finite: bool = True,
    step: int | None = None,
) -> torch.Tensor:
    """Validate a tensor received from `sender`; raise RemoteError with evidence if it is wrong."""
    if not isinstance(value, torch.Tensor):
        raise RemoteError(Evidence(sender, "malformed", f"expected a tensor, got {type(value).__name__}", step))
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise RemoteError(Evidence(sender, "wrong_shape", f"shape {tuple(value.shape)} != {tuple(shape)}", step))
    if dtype is not None and value.dtype != dtype:
        raise RemoteError(Evidence(sender, "wrong_dtype", f"dtype {value.dtype} != {dtype}", step))
    if finite and value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise RemoteError(Evidence(sender, "non_finite", "tensor holds NaN or Inf", step))
    return value
