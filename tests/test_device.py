"""train.device, and the float32 tolerance BTARD's validators use across devices (derivation in training/device.py)."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx import api
from phalanx.algorithms.btard.checks import GRAD_RTOL, gradient_matches
from phalanx.core.errors import ConfigError
from phalanx.training import compute_gradient, make_task
from phalanx.training.device import FLOAT32_UNIT_ROUNDOFF
from phalanx.training.task import measure_float32_error

BATCH = 16
TASKS = {  # name -> (task, layers L, longest reduction K) for the derived bound 4 L sqrt(K) u, at BATCH samples
    "digits-mlp": (lambda: make_task("digits-mlp"), 2, 128),  # the hidden width
    "digits-cnn": (lambda: make_task("digits-cnn"), 4, BATCH * 64),  # conv weight gradients: batch x positions
    "chars-gpt": (lambda: make_task("chars-gpt", block_size=64), 6, BATCH * 64),  # batch x tokens
}


def test_device_key_is_validated_in_one_line():
    with pytest.raises(ConfigError, match="train.device='gpu' is not known; allowed: auto, cpu, cuda"):
        api.config("digits-dp", set={"train.device": "gpu"})
    assert api.config("chars-gpt-pipeline", set={"train.device": "auto"}).train.device == "auto"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="train.device=cuda but torch sees no CUDA device here"):
            api.config("aspis-digits", set={"train.device": "cuda"})


@pytest.mark.parametrize("name", sorted(TASKS))
def test_float32_rounding_is_far_inside_the_cross_device_tolerance(name):
    factory, layers, width = TASKS[name]
    task = factory()
    error = measure_float32_error(task, batch_size=BATCH)
    bound = 4 * layers * math.sqrt(width) * FLOAT32_UNIT_ROUNDOFF
    print(f"{name}: float32 vs float64 gradient gap {error:.2e} (derived bound {bound:.2e}, GRAD_RTOL {GRAD_RTOL:.0e})")
    assert 0 < error < bound and 2 * bound < GRAD_RTOL
    assert 100 * 2 * error < GRAD_RTOL  # two devices' rounding together: 100x inside the validators' tolerance
    # another summation order (two half-batches, as a GPU kernel blocks its sums) stays within the tolerance
    x, y = task.batch(0, "order-probe", 0, BATCH)
    model = task.build_model(0)
    whole, _ = compute_gradient(task, model, x, y)
    half = BATCH // 2
    halves = (compute_gradient(task, model, x[:half], y[:half])[0] + compute_gradient(task, model, x[half:], y[half:])[0]) / 2
    assert not torch.equal(whole, halves) and gradient_matches(halves, whole)
    assert float((whole - halves).norm() / whole.norm()) < bound


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the CPU-versus-GPU check needs one")
@pytest.mark.parametrize("name", sorted(TASKS))
def test_gradient_on_cuda_passes_a_cpu_validator(name):
    task = TASKS[name][0]()
    x, y = task.batch(0, "device-probe", 0, 32)
    on_cpu, _ = compute_gradient(task, task.build_model(0), x, y)
    on_gpu, _ = compute_gradient(task, task.build_model(0).to("cuda"), x, y)
    gap = float((on_gpu - on_cpu).norm() / on_cpu.norm())
    print(f"{name}: cuda vs cpu gradient gap {gap:.2e} (GRAD_RTOL {GRAD_RTOL:.0e})")
    assert on_gpu.device.type == "cpu" and gradient_matches(on_gpu, on_cpu) and gradient_matches(on_cpu, on_gpu)
    assert measure_float32_error(task, device="cuda") < GRAD_RTOL / 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the GPU runs need one")
@pytest.mark.parametrize("preset, keys", [
    ("btard-digits", {"peers": 6, "steps": 20, "byzantine.count": 2, "byzantine.attack": "sign_flip"}),
    ("chars-gpt-pipeline", {"steps": 4}),
    ("aspis-digits", {"peers": 8, "steps": 5}),
])
def test_each_kind_trains_on_cuda(tmp_path, preset, keys):
    top = {k: v for k, v in keys.items() if "." not in k}
    dotted = {k: v for k, v in keys.items() if "." in k}
    summary = api.simulate(api.config(preset, **top, set={**dotted, "train.device": "cuda"}), out=tmp_path / "run")
    assert math.isfinite(summary["final_loss"])
    if preset == "btard-digits":
        assert len(summary["banned"]) == 2
