"""One-process checks of accel's CUDA paths against raw torch; prints JSON (one line per check).

For a machine with a GPU (CI has none): each check runs the same computation through raw torch
and through accel and compares, so a failure names the path that breaks on CUDA.

- ``train_<mp>``: 6 steps of an MLP (AdamW, clipping) on ``cuda:0``: raw ``torch.autocast`` (+
  ``torch.amp.GradScaler`` for fp16) vs ``accel.distributed(mixed_precision=mp)`` with
  ``prepare_model``/``prepare_optimizer``/``backward``/``clip_grad_norm_``; losses and weights
  compared (fp32 and bf16 exactly; fp16 too: the same scaler steps).
- ``resume_fp16``: ``save_state`` after 3 fp16 steps (model, AdamW, the scaler), 3 more steps;
  ``load_state`` into fresh objects, the same 3 steps: the same losses.
- ``dispatch``: a model split over ``cuda:0``, the CPU and disk by ``load_checkpoint_and_dispatch``
  gives the CPU model's output.
- ``step_overhead_<mp>``: microseconds per step, raw loop vs accel loop, paired windows (a small
  model, so the per-step Python cost shows).
- ``fp8_step_time``: milliseconds per training step (AdamW) of a Llama-style model with large
  Linears (Llama-3-8B widths: d=4096, MLP 14336; 2 blocks; 8192 tokens a step) under
  ``mixed_precision="bf16"`` and ``"fp8"`` (torchao tensorwise), eager and with
  ``compile="regional"``; ``ok`` when compiled fp8 is faster than compiled bf16. CUDA only
  (skipped on the CPU; needs ``accel[fp8]``).

Usage:
    python bench/cuda_check.py            # everything
    python bench/cuda_check.py --quick    # fewer timing windows
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accel

DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 8))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=g).to(DEVICE), torch.randn(32, 8, generator=g)
             .to(DEVICE)) for _ in range(n)]


def _raw(mp: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _net().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(DEVICE.type, enabled=mp == "fp16")
    losses = []
    for x, y in _batches(steps):
        with torch.autocast(DEVICE.type, dtype=DTYPES.get(mp, torch.float32), enabled=mp != "no"):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _accel_loop(model: nn.Module, opt: Any, batches: list[Any]) -> list[float]:
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        accel.backward(loss)
        accel.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def check_train(mp: str) -> dict[str, Any]:
    raw_losses, raw_weights = _raw(mp, 6)
    with accel.distributed(mixed_precision=mp) as st:
        model = accel.prepare_model(_net())
        opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses = _accel_loop(model, opt, _batches(6))
        weights = {k: v.detach().cpu() for k, v in accel.unwrap_model(model).state_dict().items()}
    diff = max((weights[k] - raw_weights[k]).abs().max().item() for k in raw_weights)
    return {"device": str(st.device), "loss_diff": max(abs(a - b) for a, b in
                                                     zip(losses, raw_losses, strict=True)),
            "weight_diff": diff, "ok": diff <= 1e-6 and losses == raw_losses}


def check_resume() -> dict[str, Any]:
    batches = _batches(6)
    with tempfile.TemporaryDirectory() as tmp, accel.distributed(mixed_precision="fp16"):
        model = accel.prepare_model(_net())
        opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        _accel_loop(model, opt, batches[:3])
        accel.save_state(tmp, model=model, optimizer=opt)
        scale = accel.precision.scaling.scaler_state_dict()
        after = _accel_loop(model, opt, batches[3:])
        fresh = accel.prepare_model(_net(seed=5))
        fresh_opt = accel.prepare_optimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-3))
        accel.load_state(tmp, model=fresh, optimizer=fresh_opt)
        resumed = _accel_loop(fresh, fresh_opt, batches[3:])
    return {"losses": after, "resumed": resumed, "scaler": scale, "ok": after == resumed}


def check_dispatch() -> dict[str, Any]:
    model = _net().eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = model(x)
    with tempfile.TemporaryDirectory() as tmp:
        accel.save_model(model, tmp)
        with accel.init_empty_weights():
            empty = _net()
        device_map = {"0": 0, "1": "cpu", "2": "cpu", "3": "disk", "4": 0}
        if DEVICE.type != "cuda":
            device_map = {k: ("cpu" if v == 0 else v) for k, v in device_map.items()}
        loaded = accel.load_checkpoint_and_dispatch(
            empty, tmp, device_map=device_map, offload_folder=f"{tmp}/offload"
        )
        with torch.no_grad():
            got = loaded(x.to(DEVICE)).cpu()
    diff = (got - want).abs().max().item()
    return {"device_map": device_map, "diff": diff, "ok": diff <= 1e-5}


def _per_step_us(step: Callable[[], None], steps: int) -> float:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def check_overhead(mp: str, windows: int, steps: int) -> dict[str, Any]:
    x, y = _batches(1)[0]
    raw_model = _net().to(DEVICE)
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)
    dtype = DTYPES.get(mp, torch.float32)

    def raw_step() -> None:
        with torch.autocast(DEVICE.type, dtype=dtype, enabled=mp != "no"):
            out = raw_model(x)
        nn.functional.mse_loss(out.float(), y).backward()
        raw_opt.step()
        raw_opt.zero_grad()

    with accel.distributed(mixed_precision="no" if mp == "fp16" else mp):
        model = accel.prepare_model(_net())
        opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

        def accel_step() -> None:
            accel.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

        for _ in range(20):
            raw_step()
            accel_step()
        pairs = []
        for i in range(windows):
            first, second = (raw_step, accel_step) if i % 2 == 0 else (accel_step, raw_step)
            a, b = _per_step_us(first, steps), _per_step_us(second, steps)
            raw_us, accel_us = (a, b) if i % 2 == 0 else (b, a)
            pairs.append((raw_us, accel_us))
    return {
        "raw_us": round(statistics.median(p[0] for p in pairs), 1),
        "accel_us": round(statistics.median(p[1] for p in pairs), 1),
        "overhead_us": round(statistics.median(p[1] - p[0] for p in pairs), 1),
        "ok": True,
    }


class _LlamaBlock(nn.Module):
    """Pre-norm attention (SDPA, causal) and a SwiGLU MLP, bias-free, as Llama's."""

    def __init__(self, d: int, f: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k,
                                                                          self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class _LlamaStyle(nn.Module):
    """Embedding, blocks, norm, LM head (kept in bf16 by accel's fp8 rule: vocabulary rows)."""

    def __init__(self, vocab: int = 32000, d: int = 4096, f: int = 14336, layers: int = 2,
                 heads: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_LlamaBlock(d, f, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                           ids[:, 1:].flatten())


def _fp8_step_ms(mode: str, compile: bool | str, steps: int) -> dict[str, Any]:
    """Median-free mean step time after warm-up (compilation included in the warm-up)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 32000, (4, 2048), device=DEVICE)
    with accel.distributed(mixed_precision=mode):
        with torch.device(DEVICE):
            net = _LlamaStyle()
        model = accel.prepare_model(net, compile=compile)
        opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
        float8 = sum(type(m).__name__ == "Float8Linear" for m in net.modules())

        def step() -> torch.Tensor:
            loss: torch.Tensor = model(ids)
            accel.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / steps * 1e3
    return {"ms": round(ms, 2), "loss": round(float(loss), 4), "float8_layers": float8}


def check_fp8_speed(steps: int) -> dict[str, Any]:
    if DEVICE.type != "cuda":
        return {"skipped": "CUDA only (float8 matmuls need an H100-class GPU)", "ok": True}
    out: dict[str, Any] = {}
    for compile in (False, "regional"):
        label = "compiled" if compile else "eager"
        for mode in ("bf16", "fp8"):
            out[f"{label}_{mode}"] = _fp8_step_ms(mode, compile, steps)
            gc.collect()  # the last run's model and optimizer states leave the GPU
            torch.cuda.empty_cache()
        out[f"{label}_speedup"] = round(out[f"{label}_bf16"]["ms"] / out[f"{label}_fp8"]["ms"], 3)
    out["ok"] = out["compiled_speedup"] > 1.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    windows, steps = (6, 100) if args.quick else (20, 200)
    print(json.dumps({"check": "env", "torch": torch.__version__, "device": str(DEVICE),
                      "name": torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "cpu"}),
          flush=True)
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "train_no": lambda: check_train("no"),
        "train_bf16": lambda: check_train("bf16"),
        "train_fp16": lambda: check_train("fp16"),
        "resume_fp16": check_resume,
        "dispatch": check_dispatch,
        "step_overhead_no": lambda: check_overhead("no", windows, steps),
        "step_overhead_bf16": lambda: check_overhead("bf16", windows, steps),
        "fp8_step_time": lambda: check_fp8_speed(5 if args.quick else 20),
    }
    for name, check in checks.items():
        try:
            result = check()
        except Exception as exc:  # report and go on: one broken path must not hide the others
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "where": traceback.format_exc().splitlines()[-4:]}
        print(json.dumps({"check": name, **result}, default=str), flush=True)


if __name__ == "__main__":
    main()
