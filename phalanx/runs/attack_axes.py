"""The four attack axes, one name space each, and the one config path that checks them.

- gradient: the vector a Byzantine peer sends as its gradient (`algorithms.robust.attacks.ATTACKS`);
- protocol: how a Byzantine BTARD peer lies in the protocol (`algorithms.btard.attacks.PROTOCOL_ATTACKS`);
- link: what a malicious pipeline relay sends on its links (`algorithms.sentinel.attacks.LINK_ATTACKS`);
- redundancy: which Aspis workers lie on which files (`algorithms.aspis.attacks.ORCHESTRATIONS`).

"none" (honest) is no attack; the configs that accept it say so. Config classes check an attack
name with `check_name` and its parameters with `check_params`; `phalanx attacks` prints `describe()`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from ..algorithms.aspis.attacks import DISTORTIONS, ORCHESTRATIONS
from ..algorithms.btard.attacks import PROTOCOL_ATTACKS
from ..algorithms.robust.attacks import ATTACKS
from ..algorithms.sentinel.attacks import LINK_ATTACKS
from ..core.errors import ConfigError

AXES = ("gradient", "protocol", "link", "redundancy")


def names(axis: str) -> list[str]:
    """The attacks of `axis`, in registry order, without "none"."""
    table = {"gradient": ATTACKS, "protocol": PROTOCOL_ATTACKS, "link": LINK_ATTACKS, "redundancy": ORCHESTRATIONS}[axis]
    return [name for name in table if name != "none"]


def description(axis: str, name: str) -> str:
    """One line saying what attack `name` of `axis` does: its class docstring's first line."""
    if axis == "redundancy":
        return ORCHESTRATIONS[name]
    cls = {"gradient": ATTACKS, "protocol": PROTOCOL_ATTACKS, "link": LINK_ATTACKS}[axis][name]
    doc = cls.__dict__.get("__doc__") or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def selectors(axis: str, name: str) -> list[str]:
    """The config settings that select attack `name` of `axis`, one per run kind that has it."""
    if axis == "gradient":
        found = [f"data-parallel: byzantine.attack={name}"]
        return found + ([f"aspis: attack.distortion={name}"] if name in DISTORTIONS else [])
    if axis == "protocol":
        return [f"data-parallel: byzantine.attack={name} btard.enabled=true",
                f"pipeline: byzantine.attack={name} byzantine.relays=R btard.enabled=true"]
    if axis == "link":
        return [f"pipeline: attack.name={name}"]
    return [f"aspis: attack.orchestration={name}"]


def describe() -> list[tuple[str, str, str, str]]:
    """(axis, name, description, selecting keys) of every registered attack, axis by axis."""
    return [(axis, name, description(axis, name), "; ".join(selectors(axis, name))) for axis in AXES for name in names(axis)]


def check_name(key: str, value: str, axes: tuple[str, ...], *, honest: bool = True, only: Collection[str] = ()) -> str:
    """The axis of attack `value` set at config `key` ("none" for honest), or a one-line ConfigError.

    `axes` are the axes `key` may select from; `honest` whether "none" is allowed; `only`, if
    given, the subset of those names the run kind supports.
    """
    allowed = ["none"] if honest else []
    allowed += [name for axis in axes for name in names(axis) if not only or name in only]
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not known; allowed: {', '.join(allowed)} (see 'phalanx attacks')")
    return "none" if value == "none" else next(axis for axis in axes if value in names(axis))


def check_params(key: str, value: object, name_key: str, name: str, build: Callable[[], object]) -> None:
    """Build the attack the way the runtime does; parameters that do not fit give a one-line ConfigError."""
    try:
        build()
    except ValueError as exc:
        raise ConfigError(f"{key}={value!r} do not fit {name_key}={name!r}: {exc}") from None
