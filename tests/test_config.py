"""Configs: overrides, one-line errors naming the key, presets."""

import json

import pytest

from phalanx.cli import main
from phalanx.core.errors import ConfigError
from phalanx.runs.config import override
from phalanx.runs.dp.config import RunConfig
from phalanx.runs.presets import PRESETS, get_preset


def test_override_nested_and_types():
    config = override(get_preset("digits-dp"), ["train.lr=0.2", "peers=5", "network.loss=0.1", "train.optimizer=adam"])
    assert config.train.lr == 0.2 and config.peers == 5 and config.network.loss == 0.1 and config.train.optimizer == "adam"


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("train.lrr=1", "unknown key 'train.lrr'; allowed: train.task"),
        ("peers=many", "peers='many' is not a valid int"),
        ("network.loss=1.5", "network.loss=1.5 must be in [0, 1)"),
        ("train.optimizer=rmsprop", "train.optimizer='rmsprop' is not allowed"),
        ("train=3", "'train' is a group"),
        ("nonsense", "expects key=value"),
        ("train.corpus=/no/such/file.txt", "train.corpus is only used by train.task='chars-gpt'"),
        ("train.task=imagenet", "train.task='imagenet' is not known; allowed: digits-mlp"),
        ("byzantine.attack=teleport", "byzantine.attack='teleport' is not known; allowed: none, sign_flip"),
    ],
)
def test_bad_overrides_name_the_key(assignment, message):
    with pytest.raises(ConfigError) as exc:
        override(get_preset("digits-dp"), [assignment])
    assert message in str(exc.value)


def test_config_json_roundtrip_and_unknown_keys():
    config = get_preset("digits-dp-crash")
    assert RunConfig.from_dict(json.loads(config.to_json())) == config
    data = json.loads(config.to_json())
    data["train"]["bogus"] = 1
    with pytest.raises(ConfigError, match="unknown key 'train.bogus'"):
        RunConfig.from_dict(data)


def test_every_preset_builds_and_describes_itself():
    for name, fn in PRESETS.items():
        assert fn().preset == name
        assert fn.__doc__.strip()


def test_cli_reports_config_errors_in_one_line(capsys):
    assert main(["simulate", "digits-dp", "--set", "train.momentum=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.momentum=2.0 must be in [0, 1)" in err
    assert main(["simulate", "no-such-preset"]) == 2
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err


def test_cli_presets_lists_all(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS)


def test_user_corpus_file(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    config = override(get_preset("chars-gpt-dp"), [f"train.corpus={text}"])
    from phalanx.runtime.dp.peer import task_of

    assert task_of(config.train).corpus.vocab_size == len(set(text.read_text()))
    with pytest.raises(ConfigError, match="is not a readable file"):
        override(get_preset("chars-gpt-dp"), [f"train.corpus={tmp_path / 'missing.txt'}"])


def test_overrides_are_validated_together_not_one_by_one():
    config = override(get_preset("digits-dp"), ["byzantine.count=20", "peers=40"])
    assert config.peers == 40 and config.byzantine.count == 20
    with pytest.raises(ConfigError, match="must leave the 2 evaluating peers honest"):
        override(get_preset("digits-dp"), ["byzantine.count=20"])


def test_report_rejects_what_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "summary.json not found" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text("[1, 2]")
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a phalanx run summary" in capsys.readouterr().err


@pytest.mark.parametrize("assignment", ["jobs=-1", "task=imagenet", "lr=-1", "batch_size=0", "momentum=2"])
def test_robustness_bench_config_errors_are_one_line(assignment, capsys):
    assert main(["bench", "robustness", "--set", assignment]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("phalanx: error: ") and "\n" not in err


def test_cli_output_into_a_closed_pipe_stops_without_a_traceback():
    """`phalanx attacks | head -1`: the reader goes away; the command stops quietly (exit 1), as cat does."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "phalanx.cli", "attacks"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err
