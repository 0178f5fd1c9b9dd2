"""Every attack of every axis builds from the config path; `phalanx attacks` lists each once; unknown names fail in one line."""

from __future__ import annotations

import pytest

from phalanx import api
from phalanx.algorithms.aspis.attacks import DISTORTIONS
from phalanx.algorithms.btard.attacks import PROTOCOL_ATTACKS
from phalanx.algorithms.robust.attacks import ATTACKS
from phalanx.algorithms.sentinel.attacks import LINK_ATTACKS
from phalanx.cli import main
from phalanx.core.errors import ConfigError
from phalanx.runs.aspis.run import coalition, distortion_of
from phalanx.runs.attack_axes import AXES, describe, names
from phalanx.runs.dp.swarm import byzantine_policies


@pytest.mark.parametrize("name", names("gradient"))
def test_every_gradient_attack_builds_from_the_data_parallel_config(name):
    config = api.config("digits-dp", set=["byzantine.count=3", f"byzantine.attack={name}"])
    attack, policy = byzantine_policies(config)
    assert type(attack) is ATTACKS[name] and policy is None


@pytest.mark.parametrize("name", DISTORTIONS)
def test_every_aspis_distortion_builds_from_the_aspis_config(name):
    config = api.config("aspis-digits", set=[f"attack.distortion={name}"])
    assert type(distortion_of(config)) is ATTACKS[name]


@pytest.mark.parametrize("name", names("protocol"))
def test_every_protocol_attack_builds_from_the_btard_config(name):
    config = api.config("btard-digits", set=[f"byzantine.attack={name}"])
    attack, policy = byzantine_policies(config)
    assert type(policy) is PROTOCOL_ATTACKS[name] and attack is None
    assert len(policy.colluders) == config.byzantine.count


@pytest.mark.parametrize("name", names("link"))
def test_every_link_attack_builds_from_the_pipeline_config(name):
    config = api.config("chars-gpt-pipeline", set=[f"attack.name={name}", "attack.relays=0"])
    assert type(config.attack.policy(config.seed, "relay-0")) is LINK_ATTACKS[name]


@pytest.mark.parametrize("name", names("redundancy"))
def test_every_orchestration_builds_from_the_aspis_config(name):
    config = api.config("aspis-digits", set=[f"attack.orchestration={name}"])
    plan = coalition(config)
    assert plan is not None and plan.kind == name


def test_every_registered_attack_has_a_one_line_summary():
    for axis, name, text, keys in describe():
        assert text.endswith(".") and "(" not in text.split()[0], (axis, name, text)  # not a dataclass's signature
        assert keys, (axis, name)


def test_phalanx_attacks_lists_every_registered_name_once(capsys):
    assert main(["attacks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    registered = [(axis, name) for axis in AXES for name in names(axis)]
    assert sorted(tuple(line.split()[:2]) for line in lines) == sorted(registered)
    assert {"alie", "agg_shift", "invisible_noise", "att2"} <= {name for _, name in registered}


@pytest.mark.parametrize(
    ("preset", "key", "allowed", "refused"),
    [
        ("digits-dp", "byzantine.attack", ["alie", "agg_shift"], []),
        ("chars-gpt-pipeline", "attack.name", ["invisible_noise", "framing"], ["alie"]),
        ("aspis-digits", "attack.orchestration", ["att1", "majority"], ["alie"]),
        ("aspis-digits", "attack.distortion", list(DISTORTIONS), ["label_flip", "none"]),
    ],
)
def test_an_unknown_attack_name_names_the_allowed_ones_of_its_axis(preset, key, allowed, refused):
    with pytest.raises(ConfigError) as error:
        api.config(preset, set=[f"{key}=teleport"])
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{key}='teleport' is not known; allowed: ")
    listed = message.split("allowed: ")[1].split(" (see")[0].split(", ")
    assert set(allowed) <= set(listed) and not set(refused) & set(listed)


def test_the_cli_reports_an_unknown_attack_in_one_line(capsys):
    assert main(["simulate", "digits-dp", "--set", "byzantine.attack=teleport"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("phalanx: error: byzantine.attack='teleport' is not known") and "\n" not in err

