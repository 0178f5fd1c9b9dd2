"""Tasks on local csv / json lines / parquet / text files (through `datasets`) match the data loaded by hand and train."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets", reason="the data extra is not installed: pip install -e '.[data]'")
pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from phalanx import api  # noqa: E402
from phalanx.core.errors import ConfigError  # noqa: E402
from phalanx.training.files import (  # noqa: E402
    classification,
    holdout_split,
    language_model,
    train_tokenizer,
)

SPECIES = ("setosa", "versicolor", "virginica")


def rows() -> list[dict]:
    """Three well-separated blobs of 4 features, labelled by name."""
    rng = random.Random(7)
    out = []
    for i in range(150):
        c = rng.randrange(3)
        out.append({"id": i, **{f"f{k}": round(2.0 * c * (1 if k % 2 else -1) + rng.gauss(0, 0.5), 4) for k in range(4)},
                    "species": SPECIES[c]})
    return out


def write(path: Path, data: list[dict]) -> Path:
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(data[0]))
            writer.writeheader()
            writer.writerows(data)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    else:
        pq.write_table(pa.Table.from_pylist(data), path)
    return path


def by_hand(path: Path) -> list[dict]:
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_table_formats_match_hand_loading_and_train(tmp_path, monkeypatch, suffix):
    path = write(tmp_path / f"flowers{suffix}", rows())
    task = classification(str(path), label="species", features="f0,f1,f2,f3")
    hand = by_hand(path)
    x = torch.tensor([[float(r[f"f{k}"]) for k in range(4)] for r in hand])
    y = torch.tensor([SPECIES.index(r["species"]) for r in hand])
    train, test = holdout_split(len(hand), 0.2)
    mean, std = x[train].mean(0), x[train].std(0)
    assert torch.allclose(task.x_train, (x[train] - mean) / std, atol=1e-5)
    assert torch.equal(task.y_train, y[train]) and torch.equal(task.y_test, y[test])
    assert task.classes == list(SPECIES)

    monkeypatch.chdir(tmp_path)
    keys = {"train.eval_every": 15}
    if suffix == ".csv":  # BTARD's validators recompute a lying peer's gradient from the file's public batches
        keys.update({"byzantine.count": 1, "byzantine.attack": "sign_flip", "byzantine.start_step": 2})
    summary = api.simulate(api.config("btard-digits" if suffix == ".csv" else "digits-dp", peers=4, steps=15,
                                      task="phalanx.training.files:classification",
                                      task_params={"path": path.name, "label": "species", "features": "f0,f1,f2,f3"},
                                      set=keys), out=tmp_path / "run")
    assert summary["final_accuracy"] > 0.9, summary
    bans = [json.loads(line) for line in (tmp_path / "run" / "bans.jsonl").read_text().splitlines()] if suffix == ".csv" else []
    assert len(summary["banned"]) == len(bans) == (1 if suffix == ".csv" else 0)
    assert all(ban["reason"] == "gradient" for ban in bans)  # caught by recomputing its gradient


def test_text_file_with_char_byte_and_trained_tokenizers(tmp_path, monkeypatch):
    words = "the quick brown fox jumps over the lazy dog while phalanx peers train together".split()
    rng = random.Random(3)
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)]
    path = tmp_path / "book.txt"
    path.write_text("\n".join(lines) + "\n")
    text = "\n".join(lines)  # the text builder yields one row per line, joined back with newlines

    chars = sorted(set(text))
    char_task = language_model(str(path), tokenizer="char", block_size=16)
    ids = torch.tensor([chars.index(c) for c in text])
    n_val = int(len(ids) * 0.1)
    assert char_task.cfg.vocab_size == len(chars) and torch.equal(char_task.corpus.train, ids[:-n_val])

    byte_task = language_model(str(path), tokenizer="byte", block_size=16)
    assert torch.equal(byte_task.corpus.val, torch.tensor(list(text.encode()))[-n_val:])

    from tokenizers import Tokenizer

    tok_path = train_tokenizer(lines, 300, tmp_path / "tokenizer.json")
    bpe_task = language_model(str(path), tokenizer=str(tok_path), block_size=16)
    assert torch.equal(torch.cat([bpe_task.corpus.train, bpe_task.corpus.val]), torch.tensor(Tokenizer.from_file(str(tok_path)).encode(text).ids))
    assert bpe_task.cfg.vocab_size <= 300 and len(bpe_task.corpus.train) < len(char_task.corpus.train)  # BPE merges

    monkeypatch.chdir(tmp_path)
    api.simulate(api.config("chars-gpt-dp", peers=2, steps=20, task="phalanx.training.files:language_model",
                            task_params={"path": "book.txt", "tokenizer": "tokenizer.json", "block_size": 16},
                            set={"train.eval_every": 20, "train.lr": 0.01}), out=tmp_path / "run")
    curve = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert curve[-1] < 0.7 * curve[0], curve


def test_bad_columns_name_the_columns(tmp_path):
    path = write(tmp_path / "flowers.csv", rows()[:20])
    with pytest.raises(ConfigError, match="task.params.label='kind' is not a column .* columns: id, f0, f1, f2, f3, species"):
        classification(str(path), label="kind")
    with pytest.raises(ConfigError, match="unknown file type"):
        classification(str(tmp_path / "flowers.xlsx"))
