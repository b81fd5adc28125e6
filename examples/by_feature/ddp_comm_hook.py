"""DDP communication hooks: compress the gradients DDP all-reduces (fp16, bf16, PowerSGD...).

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/ddp_comm_hook.py \
        --ddp-comm-hook power_sgd --ddp-comm-wrapper fp16 --matrix-approximation-rank 2

Accelerate's ``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...)`` are options of
``accel.distributed()`` (or of ``accel.prepare_model``, or the config file): ``comm_hook`` is
``"no"``, ``"fp16"``, ``"bf16"``, ``"power_sgd"``, ``"batched_power_sgd"`` or your own function
``hook(state, bucket)`` (``--ddp-comm-hook custom`` registers the counting hook below with
``prepare_model``); ``comm_wrapper`` (``"fp16"``/``"bf16"``) casts the buckets around the
hook; ``comm_state_option`` holds PowerSGD's options. On one process there is no DDP and the
options are ignored. To show the hook at work, the script looks at the first layer's
all-reduced gradient: with an fp16 hook or wrapper its values are float16 numbers, with
PowerSGD it has rank ``matrix_approximation_rank``. Lines that differ from a plain loop are
marked ``# accel:``. Synthetic data, no download.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel


def make_data(n: int, seed: int) -> TensorDataset:
    """Four classes: the label is the argmax of a fixed linear map of the input."""
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ w).argmax(dim=1))


# No annotations on a hook: DDP checks them, and `from __future__ import annotations` makes
# them strings, which it refuses (accel says so when the model is prepared).
def counting_hook(calls, bucket):
    """A hook of your own: the plain mean all-reduce, counting its calls in ``calls``."""
    calls[0] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(tensor, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ddp-comm-hook", default="fp16",
                        choices=["no", "fp16", "bf16", "power_sgd", "batched_power_sgd",
                                 "custom"])
    parser.add_argument("--ddp-comm-wrapper", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--matrix-approximation-rank", type=int, default=2)
    parser.add_argument("--start-powersgd-iter", type=int, default=None,
                        help="PowerSGD all-reduces plainly for the first iterations (default: "
                        "2 for power_sgd; 1000, torch's default, for batched_power_sgd, whose "
                        "compression fails in torch 2.13: see docs/training.md)")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    hook_options: dict[str, Any] = {}
    if args.ddp_comm_hook != "custom":  # accel: Accelerate's DDP kwargs, as options
        hook_options = {"comm_hook": args.ddp_comm_hook, "comm_wrapper": args.ddp_comm_wrapper}
    if args.ddp_comm_hook in ("power_sgd", "batched_power_sgd"):
        hook_options["comm_state_option"] = {
            "matrix_approximation_rank": args.matrix_approximation_rank,
            "start_powerSGD_iter": args.start_powersgd_iter
            if args.start_powersgd_iter is not None
            else (2 if args.ddp_comm_hook == "power_sgd" else 1000),
        }
    with accel.distributed(seed=0, **hook_options):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        first = model[0].weight  # the parameter whose gradient is inspected
        calls = [0]
        if args.ddp_comm_hook == "custom":  # accel: a callable hook and its state
            model = accel.prepare_model(model, comm_hook=counting_hook, comm_state=calls)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train = DataLoader(make_data(256, 1), batch_size=16, shuffle=True)
        model, optimizer, train = accel.prepare(model, optimizer, train)

        steps = fp16_values = 0
        for epoch in range(args.epochs):
            model.train()
            for x, y in train:
                with accel.accumulate(model):
                    loss = nn.functional.cross_entropy(model(x), y)
                    accel.backward(loss)
                    assert first.grad is not None
                    grad = first.grad.detach().clone()  # after DDP's (hooked) all-reduce
                    optimizer.step()
                    optimizer.zero_grad()
                steps += 1
                fp16_values += int(torch.equal(grad, grad.half().float()))
            accel.print(f"epoch {epoch}: last loss {loss.item():.4f}")

        singular = torch.linalg.svdvals(grad)
        rank = int((singular > singular[0] * 1e-2).sum())
        accel.print(f"comm hook {args.ddp_comm_hook!r}, wrapper {args.ddp_comm_wrapper!r}")
        accel.print(f"steps whose gradient holds only float16 values: {fp16_values} of {steps}")
        accel.print(f"rank of the last {tuple(grad.shape)} gradient: {rank}")
        if args.ddp_comm_hook == "custom":
            accel.print(f"custom hook called {calls[0]} times in {steps} steps")


if __name__ == "__main__":
    main()
