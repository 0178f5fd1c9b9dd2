"""Training substrate: what is trained, on which public data, and how gradients are flattened.

data.py  -- digits and character-corpus datasets; batch_indices, the public per-(peer, step) sampler
mlp.py   -- MLP classifier          cnn.py -- small CNN for 8x8 digits
gpt.py   -- nanoGPT-style GPT, cut-able into pipeline stages (GPT.stages)
staging.py -- contiguous_stages, the even split of a model's units that MLP.stages and GPT.stages use
device.py -- train.device (auto, cpu, cuda), strict float32 on CUDA, the cross-device tolerance derivation
plugin.py -- TaskConfig and load_task: a user's Task named by task.factory=package.module:function
task.py  -- Task (model + data + loss + eval), make_task, flat param/grad helpers, compute_gradient
"""
from .cnn import CNN
from .data import CharCorpus, DigitsSplit, batch_indices, batch_seed, load_digits_split
from .device import resolve_device, to_model
from .gpt import GPT, GPTConfig
from .mlp import MLP
from .plugin import TaskConfig, load_task
from .task import (
    TASKS,
    CharGPTTask,
    DigitsTask,
    Task,
    compute_gradient,
    default_stages,
    flat_grad,
    flat_params,
    make_task,
    num_params,
    seeded,
    set_flat_grad,
    set_flat_params,
    train_flops,
)

__all__ = [
    "CNN", "CharCorpus", "DigitsSplit", "batch_indices", "batch_seed", "load_digits_split",
    "GPT", "GPTConfig", "MLP", "TaskConfig", "load_task", "default_stages", "resolve_device", "to_model",
    "TASKS", "CharGPTTask", "DigitsTask", "Task", "compute_gradient", "flat_grad", "flat_params",
    "make_task", "num_params", "seeded", "set_flat_grad", "set_flat_params", "train_flops",
]
