"""A small training run for the elastic tests: it resumes from the newest checkpoint under
``root`` (whatever world size saved it), saves one every ``every`` optimizer steps, and writes
the final weights to ``out`` (safetensors, rank 0).

Used as a function by ``tests/multiproc/test_elastic_resume.py`` (``run_distributed``, inside
``accel.distributed(keep_global_batch=..., ...)``) and as a script by the launch and
namespaced-machine tests (``accel launch ... elastic_script.py ROOT OUT [--every K]
[--pause S] [--stop-after N]``; the options then come from ``accel launch``).

Per-rank batch 4, 48 samples: 12 batches an epoch, a multiple of the global batch in batches
(keep_global_batch x gradient_accumulation_steps = 2 x 1 or 2 x 2), 3 epochs. Shuffled,
SGD with momentum (optimizer state) and a StepLR schedule.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

import safetensors.torch
import torch
from torch.utils.data import DataLoader, TensorDataset

import accel

EPOCHS = 3


def _objects() -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(48, 4, generator=gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(48, 1, generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
    return accel.prepare(model, opt, loader, sched)  # type: ignore[no-any-return]


def train(root: str, out: str | None = None, *, every: int = 2, stop_after: int = 0,
          pause: float = 0.0) -> dict[str, Any]:
    """Train (resuming from ``root``), return what this rank saw; ``every=0`` saves nothing,
    ``stop_after`` > 0 returns after that optimizer step (a run that dies there, its last
    checkpoint kept)."""
    st = accel.state()
    model, opt, loader, sched = _objects()
    info = accel.load_state(root, missing_ok=True, model=model, optimizer=opt,
                            scheduler=sched, train_loader=loader)
    step = 0 if info is None or info.step is None else info.step
    seen = {"world_size": st.world_size, "accumulation": st.gradient_accumulation_steps,
            "resumed_from": step, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}
    if st.is_main_process:
        print(f"ELASTIC world={st.world_size} accumulation={st.gradient_accumulation_steps} "
              f"resumed_from={step}", flush=True)
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            with accel.accumulate(model) as sync:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accel.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if not sync:
                continue
            step += 1
            if every and step % every == 0:
                accel.save_state(root, step=step, model=model, optimizer=opt,
                                 scheduler=sched, train_loader=loader)
                if st.is_main_process:
                    print(f"ELASTIC saved step={step}", flush=True)
            if stop_after and step == stop_after:
                return {**seen, "stopped": step}
            time.sleep(pause)
    weights = {k: v.detach().clone().contiguous() for k, v in accel.get_state_dict(model).items()}
    if out is not None and st.is_main_process:
        safetensors.torch.save_file(weights, out)
        print(f"ELASTIC done steps={step} lr={sched.get_last_lr()[0]:.6g}", flush=True)
    return {**seen, "steps": step, "weights": weights, "lr": sched.get_last_lr()[0]}


def train_quietly(root: str, every: int = 0, stop_after: int = 0) -> dict[str, Any]:
    """:func:`train` for ``run_distributed`` (positional arguments), without the warning a
    resume at another world size gives ("per-rank RNG states are not restored")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return train(root, every=every, stop_after=stop_after)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--pause", type=float, default=0.0)
    args = parser.parse_args(argv)
    with accel.distributed():
        train(args.root, args.out, every=args.every, pause=args.pause)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
