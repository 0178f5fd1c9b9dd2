"""Tasks on a user's own files (csv, json lines, parquet, plain text), read by Hugging Face `datasets`.

Only local files are read: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set
before `datasets` is imported, so nothing is ever fetched from a hub. Name
either factory with task.factory:

    --set task.factory=phalanx.training.files:classification --set task.params.path=data.csv
          --set task.params.label=species [--set task.params.features=a,b,c]
    --set task.factory=phalanx.training.files:language_model --set task.params.path=book.txt
          [--set task.params.tokenizer=char|byte|tokenizer.json]

Batches stay public: each is drawn by `batch_indices(run_seed, peer, step)`
from the loaded rows (classification) or token windows (language modelling),
so validators recompute any peer's gradient exactly as for the built-in tasks.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..core.errors import ConfigError
from .data import batch_indices
from .mlp import MLP
from .task import CharGPTTask, Task, _evaluate, seeded

FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
HOLDOUT_SPLIT_SEED = 20_251_125  # fixed: which rows are held out is part of the protocol, not of a run


def load_local(path: str | Path):
    """A local file as a `datasets.Dataset` (builder chosen by suffix: .csv, .json/.jsonl, .parquet, .txt)."""
    path = Path(path)
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise ConfigError(f"task.params.path={str(path)!r}: unknown file type; use one of {', '.join(FORMATS)}")
    if not path.is_file():
        raise ConfigError(f"task.params.path={str(path)!r} is not a file")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset(builder, data_files=str(path.resolve()), split="train")


def holdout_split(n: int, test_fraction: float) -> tuple[Tensor, Tensor]:
    """(train rows, test rows): a fixed permutation of range(n), its last test_fraction held out."""
    if not 0 < test_fraction < 1:
        raise ConfigError(f"task.params.test_fraction={test_fraction} must be in (0, 1)")
    n_test = max(1, int(n * test_fraction))
    if n - n_test < 1:
        raise ConfigError(f"the file has {n} rows: too few to hold out {test_fraction:.0%} and train on the rest")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(HOLDOUT_SPLIT_SEED)
    perm = torch.randperm(n, generator=gen)
    return perm[:-n_test], perm[-n_test:]


class TableTask(Task):
    """Classification of table rows: float feature columns -> a label column, with an MLP.

    String labels are numbered in sorted order (`classes`); features are
    standardised by the training rows' mean and standard deviation unless
    normalize is false.
    """

    def __init__(self, x: Tensor, y: Tensor, classes: list, name: str, hidden: tuple[int, ...] = (64,),
                 test_fraction: float = 0.2, normalize: bool = True) -> None:
        train, test = holdout_split(len(y), test_fraction)
        if normalize:
            mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-6)
            x = (x - mean) / std
        self.x_train, self.y_train = x[train].contiguous(), y[train].contiguous()
        self.x_test, self.y_test = x[test].contiguous(), y[test].contiguous()
        self.classes = classes
        self.num_classes = len(classes)
        self.name = name
        self.hidden = hidden
        self.dataset_size = len(self.y_train)

    def build_model(self, seed: int) -> nn.Module:
        return seeded(seed, lambda: MLP(self.x_train.shape[1], self.hidden, self.num_classes))

    def examples(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        return self.x_train[indices], self.y_train[indices]

    def batch(self, run_seed: int, peer: str, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        return self.examples(batch_indices(run_seed, peer, step, batch_size, self.dataset_size))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return _evaluate(model, self.x_test, self.y_test)


def classification(path: str, label: str = "label", features: str = "", hidden: str | int = 64,
                   test_fraction: float = 0.2, normalize: bool = True) -> TableTask:
    """A TableTask on `path`: `features` is a comma-separated column list ("" = every column but `label`);
    `hidden` the MLP's hidden widths ("64" or "128,64")."""
    table = load_local(path)
    columns = table.column_names
    if label not in columns:
        raise ConfigError(f"task.params.label={label!r} is not a column of {path}; columns: {', '.join(columns)}")
    names = [c.strip() for c in str(features).split(",") if c.strip()] or [c for c in columns if c != label]
    missing = [c for c in names if c not in columns]
    if missing:
        raise ConfigError(f"task.params.features names {', '.join(missing)}, not columns of {path}; columns: {', '.join(columns)}")
    data = table.with_format("numpy")
    try:
        x = torch.stack([torch.as_tensor(data[c], dtype=torch.float32) for c in names], dim=1)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"task.params.features: every feature column of {path} must be numeric ({exc})") from None
    raw = table[label]
    classes = sorted(set(raw))
    index = {c: i for i, c in enumerate(classes)}
    y = torch.tensor([index[v] for v in raw], dtype=torch.int64)
    widths = tuple(int(w) for w in str(hidden).split(",") if w.strip())
    return TableTask(x, y, classes, f"table-{Path(path).stem}", widths, float(test_fraction), bool(normalize))


@dataclass(frozen=True)
class TokenCorpus:
    """A token-id sequence split contiguously into train and val (the last val_fraction), like CharCorpus."""

    name: str
    vocab_size: int
    train: Tensor
    val: Tensor
    digest: str  # sha256 of the int64 token ids: peers can check that they train on the same data


def encode_text(text: str, tokenizer: str) -> tuple[Tensor, int]:
    """(int64 ids, vocab size) of `text` under "char" (sorted characters of the text), "byte" (UTF-8, 256)
    or the path of a `tokenizers` JSON file trained locally."""
    if tokenizer == "char":
        chars = sorted(set(text))
        index = {c: i for i, c in enumerate(chars)}
        return torch.tensor([index[c] for c in text], dtype=torch.int64), len(chars)
    if tokenizer == "byte":
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64), 256
    if not Path(tokenizer).is_file():
        raise ConfigError(f"task.params.tokenizer={tokenizer!r} must be char, byte or a tokenizers JSON file")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    return torch.tensor(tok.encode(text).ids, dtype=torch.int64), tok.get_vocab_size()


def train_tokenizer(texts: list[str], vocab_size: int, path: str | Path) -> Path:
    """Train a byte-level BPE tokenizer on `texts` locally and save it to `path` (a JSON file)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return Path(path)


def text_of(path: str | Path, column: str = "text") -> str:
    """The rows of `column` joined by newlines (a .txt file: its lines)."""
    table = load_local(path)
    if column not in table.column_names:
        raise ConfigError(f"task.params.column={column!r} is not a column of {path}; columns: {', '.join(table.column_names)}")
    return "\n".join(str(v) for v in table[column])


def language_model(path: str, column: str = "text", tokenizer: str = "char", block_size: int = 64,
                   n_layer: int = 2, n_head: int = 2, n_embd: int = 64, val_fraction: float = 0.1) -> CharGPTTask:
    """Next-token prediction on the text of `path` with the small GPT (CharGPTTask on a TokenCorpus)."""
    ids, vocab = encode_text(text_of(path, column), str(tokenizer))
    if not 0 < val_fraction < 1:
        raise ConfigError(f"task.params.val_fraction={val_fraction} must be in (0, 1)")
    n_val = max(1, int(len(ids) * val_fraction))
    digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()
    corpus = TokenCorpus(f"{Path(path).name}:{tokenizer}", vocab, ids[:-n_val].clone(), ids[-n_val:].clone(), digest)
    task = CharGPTTask(corpus, int(block_size), int(n_layer), int(n_head), int(n_embd))
    task.name = f"lm-{corpus.name}"
    return task
