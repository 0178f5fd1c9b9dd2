"""Compute one peer's public-batch gradient in a fresh process and torch.save it.

usage: gradient_worker.py TASK[,TASK...] RUN_SEED PEER STEP OUT [--model-seed N] [--batch-size N]
Used by tests/test_training.py to check cross-process reproducibility; OUT holds {task: {"grad", "loss"}}.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx.training import compute_gradient, make_task  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("task")
    parser.add_argument("run_seed", type=int)
    parser.add_argument("peer")
    parser.add_argument("step", type=int)
    parser.add_argument("out")
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)  # fixed reduction order in matmuls
    results = {}
    for name in args.task.split(","):
        task = make_task(name)
        model = task.build_model(args.model_seed)
        x, y = task.batch(args.run_seed, args.peer, args.step, args.batch_size)
        grad, loss = compute_gradient(task, model, x, y)
        results[name] = {"grad": grad, "loss": loss}
    torch.save(results, args.out)


if __name__ == "__main__":
    main()
