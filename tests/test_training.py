"""Tests for phalanx.training: public batches, deterministic models, flat vectors, tasks."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.training import (
    GPT,
    CharCorpus,
    GPTConfig,
    batch_indices,
    batch_seed,
    compute_gradient,
    flat_grad,
    flat_params,
    load_digits_split,
    make_task,
    num_params,
    set_flat_grad,
    set_flat_params,
    train_flops,
)

WORKER = Path(__file__).with_name("gradient_worker.py")
REPO = WORKER.parent.parent
TASK_NAMES = ["digits-mlp", "digits-cnn", "chars-gpt"]


@pytest.fixture(scope="module")
def tasks():
    return {name: make_task(name) for name in TASK_NAMES}


# --- public minibatch sampling ----------------------------------------------

def test_batch_indices_deterministic_and_in_range():
    a = batch_indices(1, "peer-a", 5, 64, 100)
    b = batch_indices(1, "peer-a", 5, 64, 100)
    assert a.dtype == torch.int64 and a.shape == (64,)
    assert torch.equal(a, b)
    assert 0 <= int(a.min()) and int(a.max()) < 100


def test_batch_indices_differ_by_peer_step_and_seed():
    base = batch_indices(1, "peer-a", 5, 64, 10_000)
    assert not torch.equal(base, batch_indices(1, "peer-b", 5, 64, 10_000))
    assert not torch.equal(base, batch_indices(1, "peer-a", 6, 64, 10_000))
    assert not torch.equal(base, batch_indices(2, "peer-a", 5, 64, 10_000))
    # the encoding is injective: concatenation-style aliases get different seeds
    assert batch_seed(1, "a1", 2) != batch_seed(1, "a", 12)


def test_batch_indices_ignore_and_preserve_global_rng():
    torch.manual_seed(0)
    a = batch_indices(3, "p", 0, 16, 50)
    state = torch.get_rng_state()
    torch.manual_seed(12345)
    b = batch_indices(3, "p", 0, 16, 50)
    assert torch.equal(a, b)
    torch.set_rng_state(state)
    batch_indices(3, "p", 1, 16, 50)
    assert torch.equal(torch.get_rng_state(), state)


def test_batch_indices_rejects_bad_arguments():
    with pytest.raises(ValueError):
        batch_indices(0, "p", 0, 0, 10)
    with pytest.raises(ValueError):
        batch_indices(0, "p", 0, 4, 0)
    with pytest.raises(TypeError):
        batch_indices(0, 7, 0, 4, 10)


def test_task_batches_are_public(tasks):
    for task in tasks.values():
        x1, y1 = task.batch(9, "p", 3, 8)
        x2, y2 = task.batch(9, "p", 3, 8)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert len(x1) == len(y1) == 8


# --- datasets -------------------------------------------------------------------

def test_digits_split_fixed_and_scaled():
    d = load_digits_split()
    assert d.x_train.shape == (1437, 64) and d.x_test.shape == (360, 64)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert float(d.x_train.min()) >= 0.0 and float(d.x_train.max()) <= 1.0
    assert set(d.y_test.tolist()) == set(range(10))
    load_digits_split.cache_clear()
    again = load_digits_split()
    assert torch.equal(d.x_test, again.x_test) and torch.equal(d.y_train, again.y_train)


def test_char_corpus_from_file(tmp_path):
    text = "the quick brown fox jumps over the lazy dog\n" * 20
    path = tmp_path / "c.txt"
    path.write_text(text)
    c = CharCorpus.from_file(path)
    assert c.chars == "".join(sorted(set(text)))
    assert len(c.train) + len(c.val) == len(text)
    assert c.decode(torch.cat([c.train, c.val])) == text
    assert torch.equal(c.encode("fox"), torch.tensor([c.chars.index(ch) for ch in "fox"]))


def test_char_corpus_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="nope.txt"):
        CharCorpus.from_file(missing)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.txt"):
        CharCorpus.from_file(empty)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc")
    with pytest.raises(ValueError, match="tiny.txt"):
        CharCorpus.from_file(tiny)


def test_default_corpus_deterministic():
    c = CharCorpus.default()
    assert 200_000 <= len(c.train) + len(c.val) <= 500_000
    assert c.vocab_size <= 96
    fresh = CharCorpus.from_text(c.decode(torch.cat([c.train, c.val])))
    assert fresh.digest == c.digest


def test_gpt_task_rejects_corpus_smaller_than_a_window(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("x" * 300)
    with pytest.raises(ValueError, match="block_size"):
        make_task("chars-gpt", corpus=path, block_size=64)


# --- models and tasks -----------------------------------------------------------

def test_make_task_unknown_name():
    with pytest.raises(ValueError, match="digits-mlp"):
        make_task("imagenet-resnet")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_model_init_deterministic(tasks, name):
    task = tasks[name]
    rng = torch.get_rng_state()
    a, b, c = task.build_model(0), task.build_model(0), task.build_model(1)
    assert torch.equal(torch.get_rng_state(), rng)  # init does not consume the caller's RNG
    assert torch.equal(flat_params(a), flat_params(b))
    assert not torch.equal(flat_params(a), flat_params(c))


@pytest.mark.parametrize("name", TASK_NAMES)
def test_gradient_loss_and_evaluate(tasks, name):
    task = tasks[name]
    model = task.build_model(0)
    x, y = task.batch(0, "p", 0, 16)
    grad, loss = compute_gradient(task, model, x, y)
    assert grad.dtype == torch.float32 and grad.dim() == 1 and grad.is_contiguous()
    assert grad.numel() == num_params(model) and torch.isfinite(grad).all()
    assert loss > 0 and loss == pytest.approx(task.loss(model, x, y).item(), rel=1e-6)
    metrics = task.evaluate(model)
    assert set(metrics) == {"loss", "accuracy"} and 0.0 <= metrics["accuracy"] <= 1.0
    assert train_flops(task, model, 32) == 2 * train_flops(task, model, 16) > 0


def test_label_map_changes_gradient(tasks):
    task = tasks["digits-mlp"]
    model = task.build_model(0)
    x, y = task.batch(0, "p", 0, 32)
    honest, _ = compute_gradient(task, model, x, y)
    flipped, _ = compute_gradient(task, model, x, y, label_map=lambda t: 9 - t)
    assert not torch.allclose(honest, flipped)
    again, _ = compute_gradient(task, model, x, y)
    assert torch.equal(honest, again)


def test_flat_vectors_round_trip(tasks):
    task = tasks["digits-cnn"]
    model = task.build_model(0)
    n = num_params(model)
    vec = torch.arange(n, dtype=torch.float32) / n
    set_flat_grad(model, vec)
    assert torch.equal(flat_grad(model), vec)
    set_flat_params(model, vec * 2)
    assert torch.equal(flat_params(model), vec * 2)
    model.zero_grad(set_to_none=True)
    assert torch.equal(flat_grad(model), torch.zeros(n))
    with pytest.raises(ValueError):
        set_flat_grad(model, vec[:-1])
    with pytest.raises(ValueError):
        set_flat_params(model, vec.view(1, -1))


def test_gpt_forward_and_stages():
    cfg = GPTConfig(vocab_size=11, block_size=16, n_layer=3, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, 11, (4, 16))
    logits = model(idx)
    assert logits.shape == (4, 16, 11)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), idx.reshape(-1))
    assert torch.isfinite(loss)
    for k in range(1, cfg.n_layer + 3):
        stages = model.stages(k)
        assert len(stages) == k
        assert sum(num_params(s) for s in stages) == num_params(model)  # a partition, no copies
        h = idx
        for stage in stages:
            h = stage(h)
        assert torch.equal(h, logits)
    with pytest.raises(ValueError):
        model.stages(cfg.n_layer + 3)
    with pytest.raises(ValueError):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_digits_mlp_sgd_reaches_93_percent(tasks):
    task = tasks["digits-mlp"]
    model = task.build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(300):
        x, y = task.batch(0, "solo", step, 32)
        compute_gradient(task, model, x, y)
        opt.step()
    assert task.evaluate(model)["accuracy"] >= 0.93


# --- cross-process reproducibility ----------------------------------------------

def test_gradient_reproducible_across_processes(tmp_path):
    names = ["digits-mlp", "chars-gpt"]  # both tasks in each worker: three processes, not six
    jobs = {"a": ("peer-7", 11), "b": ("peer-7", 11), "other_step": ("peer-7", 12)}
    procs = {
        key: subprocess.Popen([sys.executable, str(WORKER), ",".join(names), "42", peer, str(step), str(tmp_path / key)],
                              cwd=REPO, stderr=subprocess.PIPE, text=True)
        for key, (peer, step) in jobs.items()
    }
    for key, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"worker {key} failed:\n{err}"
    results = {key: torch.load(tmp_path / key) for key in jobs}

    for name in names:
        out = {key: result[name] for key, result in results.items()}
        # Same code, same machine, one thread each: the float operations run in the
        # same order, so a validator's recomputation must be bitwise identical.
        # (Catches per-process state leaking into batches or init, e.g. hash(peer).)
        assert torch.equal(out["a"]["grad"], out["b"]["grad"])
        assert out["a"]["loss"] == out["b"]["loss"]
        assert not torch.allclose(out["a"]["grad"], out["other_step"]["grad"])

        # In this process the thread count may differ, which may reorder float sums;
        # float32 rounding then allows a few ulps per element: rtol 1e-5, atol 1e-7.
        task = make_task(name)
        x, y = task.batch(42, "peer-7", 11, 32)
        grad, _ = compute_gradient(task, task.build_model(0), x, y)
        torch.testing.assert_close(grad, out["a"]["grad"], rtol=1e-5, atol=1e-7)
