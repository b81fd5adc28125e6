"""Run under torchrun by test_vs_accelerate.py: one training loop, written for Accelerate or accel.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        vs_accelerate_script.py MODE OUT [MIXED_PRECISION]

MODE is ``accelerate`` or ``accel``. Both loops use the same seed, model, data, optimizer,
scheduler, accumulation, clipping and gather_for_metrics, each written the library's idiomatic
way. Rank 0 saves the final weights to OUT (safetensors); every rank writes a per-step trace
to ``OUT.rank{r}.json`` (batch sample ids, sync flag, loss, clipped grad norm, lr, gathered
count) so that a difference can be located.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# 53 samples, batch 4: 14 batches, the last holding 1 real sample (even_batches pads it with
# samples 0..2); 7 batches per rank, so with 2 accumulation steps the epoch's last batch is
# synced by the end-of-loader rule (not by the counter), and the counter must reset per epoch.
N_SAMPLES = 53
BATCH_SIZE = 4
ACCUMULATION_STEPS = 2
EPOCHS = 2
MAX_NORM = 0.4
LR = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5))


def make_loader() -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, 10, generator=gen)
    y = torch.randint(0, 5, (N_SAMPLES,), generator=gen)
    idx = torch.arange(N_SAMPLES)
    return DataLoader(TensorDataset(idx, x, y), batch_size=BATCH_SIZE, shuffle=False)


def make_optim(
    model: nn.Module,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    # a schedule whose value depends on the exact number of scheduler steps taken
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    return optimizer, scheduler


_KEEP_UNTIL_EXIT: list[object] = []


def run_accelerate(mixed_precision: str) -> tuple[dict, list, int]:
    from accelerate import Accelerator

    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION_STEPS, mixed_precision=mixed_precision, cpu=True
    )
    model = make_model()
    optimizer, scheduler = make_optim(model)
    loader = make_loader()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    trace: list = []
    for epoch in range(EPOCHS):
        model.train()
        gathered = 0
        for idx, x, y in loader:
            with accelerator.accumulate(model):
                out = model(x)
                loss = nn.functional.cross_entropy(out, y)
                accelerator.backward(loss)
                norm = None
                if accelerator.sync_gradients:
                    norm = float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            preds, ids = accelerator.gather_for_metrics((out.argmax(dim=1), idx))
            gathered += preds.numel()
            trace.append(
                {
                    "epoch": epoch,
                    "ids": idx.tolist(),
                    "sync": bool(accelerator.sync_gradients),
                    "loss": float(loss.detach()),
                    "norm": norm,
                    "lr": scheduler.get_last_lr()[0],
                    "gathered_ids": ids.tolist(),
                    "out_dtype": str(out.dtype),
                }
            )
        assert gathered == N_SAMPLES, (epoch, gathered)
    accelerator.wait_for_everyone()
    state = accelerator.unwrap_model(model).state_dict()
    rank = accelerator.process_index
    accelerator.end_training()
    # end_training() left the DDP reducer the last owner of the gloo group: dropping it here
    # destroys the group, which joins gloo's threads while holding the GIL, and a thread still
    # freeing a finished all_gather's tensors waits for the GIL: a deadlock (torch 2.13, seen
    # ~1 run in 10). Kept until the process ends instead.
    _KEEP_UNTIL_EXIT.append(model)
    return state, trace, rank


def run_accel(mixed_precision: str) -> tuple[dict, list, int]:
    import accel

    with accel.distributed(
        gradient_accumulation_steps=ACCUMULATION_STEPS, mixed_precision=mixed_precision
    ) as st:
        model = make_model()
        optimizer, scheduler = make_optim(model)
        loader = make_loader()
        model, optimizer, loader, scheduler = accel.prepare(model, optimizer, loader, scheduler)
        trace: list = []
        for epoch in range(EPOCHS):
            model.train()
            gathered = 0
            for idx, x, y in loader:
                with accel.accumulate(model) as sync:
                    out = model(x)
                    loss = nn.functional.cross_entropy(out, y)
                    accel.backward(loss)
                    norm = None
                    if sync:
                        norm = float(accel.clip_grad_norm_(model.parameters(), MAX_NORM))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                preds, ids = accel.gather_for_metrics((out.argmax(dim=1), idx))
                gathered += preds.numel()
                trace.append(
                    {
                        "epoch": epoch,
                        "ids": idx.tolist(),
                        "sync": bool(sync),
                        "loss": float(loss.detach()),
                        "norm": norm,
                        "lr": scheduler.get_last_lr()[0],
                        "gathered_ids": ids.tolist(),
                        "out_dtype": str(out.dtype),
                    }
                )
            assert gathered == N_SAMPLES, (epoch, gathered)
        accel.wait_for_everyone()
        state = accel.unwrap_model(model).state_dict()
        return state, trace, st.rank


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    mixed_precision = sys.argv[3] if len(sys.argv) > 3 else "no"
    runner = {"accelerate": run_accelerate, "accel": run_accel}[mode]
    state, trace, rank = runner(mixed_precision)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(trace, f)
    if rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, out)


if __name__ == "__main__":
    main()
