"""The run-kind registry: each kind's config names its kind, every entry point dispatches through KINDS,
old run directories (no kind in config.json) still load, and a kind's missing feature is a clear error."""

import json

import pytest

from phalanx import api
from phalanx.cli import main
from phalanx.core.errors import ConfigError
from phalanx.runs.config import kind_name
from phalanx.runs.dp.config import RunConfig
from phalanx.runs.kinds import KINDS, kind_named, kind_of
from phalanx.runs.presets import PRESETS, get_preset

ONE_PRESET = {"data-parallel": "digits-dp", "pipeline": "chars-gpt-pipeline", "aspis": "aspis-digits"}


def test_every_preset_belongs_to_a_kind_whose_config_round_trips_through_config_json():
    seen = set()
    for name in PRESETS:
        config = get_preset(name)
        kind = kind_of(config)
        seen.add(kind.name)
        data = json.loads(config.to_json())
        assert data["kind"] == kind.name and kind_named(data) is kind
        assert kind.config_class().from_dict(data) == config
    assert seen == set(KINDS)


def test_a_config_of_another_kind_is_refused_and_old_run_directories_still_load():
    pipeline = json.loads(get_preset("chars-gpt-pipeline").to_json())
    with pytest.raises(ConfigError, match="'pipeline' run, not a 'data-parallel'"):
        RunConfig.from_dict(pipeline)
    old_dp = {k: v for k, v in json.loads(get_preset("digits-dp").to_json()).items() if k != "kind"}
    assert kind_name(old_dp) == "data-parallel" and RunConfig.from_dict(old_dp) == get_preset("digits-dp")
    old_aspis = {k: v for k, v in json.loads(get_preset("aspis-digits").to_json()).items() if k != "kind"}
    assert kind_named(old_aspis).config_class().from_dict(old_aspis) == get_preset("aspis-digits")
    with pytest.raises(ConfigError, match="known kinds"):
        kind_named({"kind": "federated"})


def test_features_a_kind_lacks_are_config_errors_that_name_the_kind(tmp_path):
    pipeline = get_preset("chars-gpt-pipeline")
    with pytest.raises(ConfigError, match="joins data-parallel and pipeline runs only.*aspis run"):
        api.join(get_preset("aspis-digits"), ["/ip4/127.0.0.1/tcp/1"])
    with pytest.raises(ConfigError, match="--index 2 names a launched node"):
        api.join(pipeline, ["/ip4/127.0.0.1/tcp/1"], index=2)
    # --netns: one host per process a launch starts (a pipeline's boundary verifiers included), named in the spec
    with pytest.raises(ConfigError, match=r"--netns names hosts \[4\]; each at most once and in \[0, 4\)"):
        api.launch(api.config("aspis-digits", peers=4, set=["aspis.q=1"]), tmp_path, netns="4:rate=1mbit")
    secure = api.config("secure-gpt-pipeline", peers=7, set=["pipeline.stages=2"])
    with pytest.raises(ConfigError, match=r"in \[0, 10\)"):
        api.launch(secure, tmp_path, netns="10:rate=1mbit")
    with pytest.raises(ConfigError, match="--resume continues data-parallel runs only"):
        api.simulate(pipeline, tmp_path, resume=object())


@pytest.mark.parametrize("kind", ["pipeline", "aspis"])
def test_report_draws_each_kind_with_its_own_report(tmp_path, kind):
    config = api.config(ONE_PRESET[kind], peers=4 if kind == "pipeline" else 4, steps=2,
                        set=["aspis.q=1", "attack.orchestration=none"] if kind == "aspis" else [])
    api.simulate(config, tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    drawn = {p.name for p in tmp_path.glob("*.png")}
    # the pipeline report draws its stage x time diagram; the data-parallel report (Aspis uses it) a timeline
    assert ("stages.png" in drawn) if kind == "pipeline" else ("loss.png" in drawn and "stages.png" not in drawn)
