"""Datasets and public minibatch sampling.

Every batch a peer trains on is a pure function of public values
(run seed, peer id, step), so any validator can recompute any peer's gradient.
Datasets are offline and deterministic: scikit-learn's bundled digits and a
character corpus built from text that ships with the Python standard library.
"""
from __future__ import annotations

import ast
import codecs
import functools
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

# ---------------------------------------------------------------------------
# public minibatch sampling

_BATCH_DOMAIN = "phalanx.batch.v1"  # domain tag: these hashes never collide with other uses of sha256


def batch_seed(run_seed: int, peer: str, step: int) -> int:
    """63-bit generator seed for (run_seed, peer, step): BTARD's xi = hash(r_t || i).

    The inputs are JSON-encoded before hashing, which is injective, so e.g.
    peer "a|1" at step 2 cannot alias peer "a" at step 12.
    """
    if not isinstance(peer, str):
        raise TypeError(f"peer must be a str, got {type(peer).__name__}")
    payload = json.dumps([_BATCH_DOMAIN, int(run_seed), peer, int(step)]).encode()
    digest = hashlib.sha256(payload).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def batch_indices(run_seed: int, peer: str, step: int, batch_size: int, dataset_size: int) -> Tensor:
    """Public sample indices (int64, shape [batch_size]) of `peer`'s batch at `step`.

    Sampling is uniform *with replacement* (i.i.d. draws, as in SGD theory), so
    batch_size may exceed dataset_size and batches of different steps are
    independent. Uses a private CPU torch.Generator: global RNG state is neither
    read nor changed.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if dataset_size <= 0:
        raise ValueError(f"dataset_size must be positive, got {dataset_size}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(batch_seed(run_seed, peer, step))
    return torch.randint(0, dataset_size, (batch_size,), generator=gen, dtype=torch.int64)


# ---------------------------------------------------------------------------
# digits (sklearn, 1797 8x8 grey images, 10 classes)

DIGITS_TEST_SIZE = 360
DIGITS_SPLIT_SEED = 1797  # fixed constant: the split is part of the protocol, not of a run


@dataclass(frozen=True)
class DigitsSplit:
    """Flattened digit images in [0, 1] (float32, [N, 64]) and int64 labels."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


@functools.lru_cache(maxsize=1)
def load_digits_split() -> DigitsSplit:
    """The fixed train/test split of sklearn digits (cached; treat tensors as read-only).

    A seeded permutation shuffles the samples (the raw file is grouped by writer),
    then the last DIGITS_TEST_SIZE samples become the test split.
    """
    from sklearn.datasets import load_digits

    raw = load_digits()
    x = torch.tensor(raw.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(raw.target, dtype=torch.int64)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(DIGITS_SPLIT_SEED)
    perm = torch.randperm(len(y), generator=gen)
    train, test = perm[:-DIGITS_TEST_SIZE], perm[-DIGITS_TEST_SIZE:]
    return DigitsSplit(x[train].contiguous(), y[train].contiguous(), x[test].contiguous(), y[test].contiguous())


# ---------------------------------------------------------------------------
# character-level text corpus

# stdlib modules whose docstrings form the default corpus, in this order
_DEFAULT_SOURCES = (
    "typing", "inspect", "logging/__init__", "doctest", "difflib", "statistics",
    "threading", "email/message", "smtplib", "configparser", "collections/__init__",
    "argparse", "functools", "json/__init__", "pathlib", "textwrap", "random",
    "fractions", "subprocess", "shutil", "unittest/case", "tarfile", "urllib/request",
    "traceback", "enum", "contextlib", "heapq",
)
DEFAULT_CORPUS_CHARS = 300_000
MIN_CORPUS_CHARS = 256  # floor against empty/truncated files; tasks also check their window size


def _printable(text: str) -> str:
    """Keep newline and printable ASCII only, so the vocabulary stays small."""
    return "".join(c for c in text.replace("\t", "    ") if c == "\n" or " " <= c <= "~")


def _docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of a source file, in source order."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = [(getattr(n, "lineno", 0), ast.get_docstring(n)) for n in ast.walk(tree) if isinstance(n, nodes)]
    return [doc for _, doc in sorted(found, key=lambda item: item[0]) if doc]


def _zen(lib: Path) -> str:
    """The Zen of Python, read from `this.py` without importing it (import prints)."""
    tree = ast.parse((lib / "this.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s":
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    raise ValueError("this.py has no rot13 string 's'")


def default_corpus_text() -> str:
    """About 300 KB of English prose: the Zen of Python, then stdlib docstrings.

    Deterministic for a given Python version; CharCorpus.digest identifies the
    exact text so peers can check that they train on the same corpus.
    """
    lib = Path(sysconfig.get_paths()["stdlib"])
    parts = [_zen(lib)]
    for name in _DEFAULT_SOURCES:
        path = lib / f"{name}.py"
        if path.exists():
            parts.extend(_docstrings(path))
    text = _printable("\n\n".join(parts))
    if len(text) < DEFAULT_CORPUS_CHARS:
        raise ValueError(f"stdlib sources under {lib} yield only {len(text)} characters of docstrings")
    return text[:DEFAULT_CORPUS_CHARS]


@dataclass(frozen=True)
class CharCorpus:
    """A text encoded as int64 character ids, split contiguously into train and val.

    The vocabulary is the sorted set of characters in the whole text; the last
    `val_fraction` of the text is the validation split.
    """

    name: str
    chars: str
    train: Tensor
    val: Tensor
    digest: str  # sha256 of the UTF-8 text

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @classmethod
    def from_text(cls, text: str, name: str = "<text>", val_fraction: float = 0.1) -> CharCorpus:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if len(text) < MIN_CORPUS_CHARS:
            raise ValueError(f"corpus {name} has {len(text)} characters, need at least {MIN_CORPUS_CHARS}")
        chars = "".join(sorted(set(text)))
        stoi = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([stoi[c] for c in text], dtype=torch.int64)
        n_val = max(1, int(len(ids) * val_fraction))
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        return cls(name, chars, ids[:-n_val].clone(), ids[-n_val:].clone(), digest)

    @classmethod
    def from_file(cls, path: str | Path, val_fraction: float = 0.1) -> CharCorpus:
        """Read a UTF-8 text file; ValueError (naming the path) if missing or too small."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"corpus file not found: {path}")
        return cls.from_text(path.read_text(encoding="utf-8"), name=str(path), val_fraction=val_fraction)

    @classmethod
    def default(cls) -> CharCorpus:
        """The built-in corpus (cached): see default_corpus_text."""
        return _default_corpus()

    def encode(self, text: str) -> Tensor:
        stoi = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([stoi[c] for c in text], dtype=torch.int64)

    def decode(self, ids: Tensor | list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@functools.lru_cache(maxsize=1)
def _default_corpus() -> CharCorpus:
    return CharCorpus.from_text(default_corpus_text(), name="stdlib-docstrings")
