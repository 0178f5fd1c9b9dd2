"""A user's task (examples/csv_cnn) named by task.factory trains under every run kind; bad tasks get one-line errors."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx.cli import main
from phalanx.core.errors import ConfigError
from phalanx.training import (
    Task,
    TaskConfig,
    batch_indices,
    default_stages,
    load_task,
    seeded,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "csv_cnn"
ADAM = ["--set", "train.optimizer=adam", "--set", "train.lr=0.01"]


@pytest.fixture(scope="module")
def pixels(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("csv") / "pixels.csv"
    runpy.run_path(str(EXAMPLE / "make_pixels_csv.py"))["write_pixels_csv"](str(path))
    return path


@pytest.fixture
def user_dir(pixels, tmp_path, monkeypatch) -> Path:
    """The user's working directory: their task module next to their CSV, as they would run phalanx."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    (tmp_path / "pixels.csv").symlink_to(pixels)
    return tmp_path


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("argv", [  # the data-parallel kind (under BTARD): test_readme_api_script_runs_as_written
    ["chars-gpt-pipeline", "--steps", "12", "--set", "train.batch_size=16"],
    ["aspis-digits", "--peers", "8", "--steps", "20"],
], ids=["pipeline", "aspis"])
def test_example_csv_cnn_trains_under_each_kind(user_dir, argv):
    out = user_dir / "run"
    rc = main(["simulate", *argv, "--config", str(EXAMPLE / "csv_cnn.toml"), "--out", str(out), "--no-progress", *ADAM])
    assert rc == 0
    config = json.loads((out / "config.json").read_text())
    assert config["task"] == {"factory": "pixel_task:make_task", "params": {"path": "pixels.csv"}}
    curve = losses(out)
    assert sum(curve[-3:]) / 3 < 0.8 * sum(curve[:3]) / 3, curve  # it learned the user's data


def test_stages_of_sequential_and_gpt_like_models_compose_to_forward():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))
    parts = default_stages(seq, 3)
    assert all(any(True for _ in p.parameters()) for p in parts)  # the parameter-free Unflatten joined the first conv

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(7, 4), nn.Linear(4, 7)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    for model, x, k in ((seq, torch.randn(2, 16), 3), (Tiny(), torch.randint(0, 7, (2, 5)), 4)):
        h = x
        for part in default_stages(model, k):
            h = part(h)
        assert torch.allclose(h, model(x))
    with pytest.raises(ValueError, match="cannot be cut into pipeline stages"):
        default_stages(nn.Linear(2, 2), 2)


class NoBatch:
    dataset_size = 10

    def build_model(self, seed):
        return nn.Linear(2, 2)


class ImpureBatch(Task):
    dataset_size = 10

    def build_model(self, seed):
        return seeded(seed, lambda: nn.Linear(2, 2))

    def batch(self, run_seed, peer, step, batch_size):
        return torch.randn(batch_size, 2), torch.randint(0, 2, (batch_size,))  # global RNG: differs each call

    def evaluate(self, model):
        return {"loss": 0.0, "accuracy": 0.0}


class PureBatch(ImpureBatch):
    def batch(self, run_seed, peer, step, batch_size):
        idx = batch_indices(run_seed, peer, step, batch_size, self.dataset_size)
        return torch.eye(10, 2)[idx], idx % 2


@pytest.mark.parametrize("factory, message", [
    ("pixel_task.make_task", "task.factory='pixel_task.make_task' must read package.module:function"),
    ("no_such_module:make_task", "task.factory='no_such_module:make_task': cannot import 'no_such_module'"),
    ("pixel_task:make_tusk", "module 'pixel_task' has no attribute 'make_tusk'"),
    (f"{__name__}:NoBatch", "returned a NoBatch that has no batch, loss, evaluate method"),
    (f"{__name__}:ImpureBatch", "draws batches that are not a pure function of (seed, peer, step)"),
])
def test_bad_task_is_one_line_error(user_dir, capsys, factory, message):
    rc = main(["simulate", "digits-dp", "--peers", "2", "--steps", "1", "--no-progress", "--set", f"task.factory={factory}"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["aspis-digits", "--peers", "4", "--set", "aspis.q=1"], "has no examples(indices) method: the Aspis kind"),
    (["chars-gpt-pipeline"], "Linear cannot be cut into pipeline stages: use an nn.Sequential"),
], ids=["aspis", "pipeline"])
def test_kind_specific_task_needs_are_one_line(user_dir, capsys, argv, message):
    rc = main(["simulate", *argv, "--steps", "1", "--no-progress", "--set", f"task.factory={__name__}:PureBatch"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_pure_task_loads_and_is_cached():
    config = TaskConfig(factory=f"{__name__}:PureBatch")
    assert load_task(config) is load_task(config)
    with pytest.raises(ConfigError, match="task.factory is empty"):
        TaskConfig(params={"path": "x.csv"})


def test_readme_api_script_runs_as_written(user_dir, capsys):
    readme = (EXAMPLE.parent.parent / "README.md").read_text()
    block = readme.split("<!-- api-script -->\n```python\n", 1)[1].split("```\n<!-- /api-script -->", 1)[0]
    assert len(block.strip().splitlines()) <= 20
    (user_dir / "script.py").write_text(block)
    runpy.run_path(str(user_dir / "script.py"), run_name="__main__")
    assert capsys.readouterr().out.startswith("accuracy ")
    summary = json.loads((user_dir / "runs" / "pixel-cnn" / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.5 and len(summary["banned"]) == 2


def test_config_file_layers_and_errors(tmp_path):
    from phalanx.api import config

    (tmp_path / "run.json").write_text(json.dumps({"steps": 7, "train": {"lr": 0.02}, "task": {"factory": "m:f", "params": {"k": 1}}}))
    loaded = config("digits-dp", file=tmp_path / "run.json", set={"train.lr": 0.03})
    assert (loaded.steps, loaded.train.lr, loaded.train.optimizer, loaded.task.params) == (7, 0.03, "sgd", {"k": 1})
    (tmp_path / "bad.toml").write_text("[train]\nlearning_rate = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'train.learning_rate'"):
        config("digits-dp", file=tmp_path / "bad.toml")
    (tmp_path / "run.yaml").write_text("steps: 7\n")
    with pytest.raises(ConfigError, match="name a .toml or .json file"):
        config("digits-dp", file=tmp_path / "run.yaml")
    with pytest.raises(ConfigError, match="no such file"):
        config("digits-dp", file=tmp_path / "missing.toml")
