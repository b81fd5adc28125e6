"""Context parallelism: training tokens/s per rank at cp=1 and cp=2 vs sequence length; curve JSON.

A transformers Llama built locally (``--layers`` layers, hidden ``--hidden``, 8 heads, 4
key/value heads, RoPE, vocabulary 256, SDPA attention: the kernel cp=2 runs too, so both
compute attention alike), AdamW, the next-token loss, a global batch of ``--batch``
sequences of each length of ``--seqs``:

- cp=1: one process, ``accel.distributed()``;
- cp=2: two gloo processes, ``accel.distributed(cp_size=2)``: each rank gets the whole batch
  and computes half of every sequence (all-to-all attention, ``cp_method="alltoall"``).

The loop is the one-process loop (``loss = model(**batch).loss``, ``accel.backward``, step,
zero_grad) on the same batches. Per point: ``--windows`` windows of ``--steps`` steps (the
slowest rank's time), the median step; tokens/s per rank = tokens of the global batch / step
time / ranks (equal at cp=1 and cp=2 when splitting the sequence costs nothing; the curve
shows how close cp=2 gets as sequences grow). The derived panel is cp2 / cp1 per rank.

Curve written (``--json-out DIR``, default bench/curves; ``-`` prints only):
``cp_tokens_per_rank``.

Usage:
    python bench/curves_cp.py                                   # full quality (~1.5 min)
    python bench/curves_cp.py --seqs 16 32 64 --windows 2 --steps 1 --json-out -   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curve_record import quartiles, record, write

import accel
from accel.testing import run_distributed


def _llama(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=65536, use_cache=False, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def measure(seq: int, batch: int, hidden: int, layers: int, windows: int,
            steps: int) -> dict[str, Any]:
    """Step times of the accel loop on this mesh (every rank; the slowest rank per window)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (batch, seq), generator=g)
    data = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    model = accel.prepare_model(_llama(hidden, layers))
    opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    def window(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = model(**data).loss
            accel.backward(loss)
            opt.step()
            opt.zero_grad()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took.item()) / n

    window(1)  # warm up
    times = []
    for _ in range(windows):
        if dist.is_initialized():
            dist.barrier()
        times.append(window(steps))
    return {"step_s": times, "cp": accel.state().cp_world_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json-out", default=None,
                        help="directory for the curve files (default bench/curves; - prints only)")
    args = parser.parse_args()
    per_cp: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for seq in args.seqs:
        for cp in (1, 2):  # alternating: both see the same machine drift
            out = run_distributed(measure, seq, args.batch, args.hidden, args.layers,
                                  args.windows, args.steps, world_size=cp, timeout=1800,
                                  **({"cp_size": 2} if cp == 2 else {}))[0]
            assert out["cp"] == cp, out["cp"]
            tokens = args.batch * seq
            rates = [tokens / s / cp for s in out["step_s"]]
            per_cp[cp].append({"seq": seq, "step_ms": statistics.median(out["step_s"]) * 1e3,
                               "tokens_per_s_per_rank": statistics.median(rates),
                               "iqr": quartiles(rates)})
    ratio = [[p1["seq"], round(p2["tokens_per_s_per_rank"] / p1["tokens_per_s_per_rank"], 3)]
             for p1, p2 in zip(per_cp[1], per_cp[2], strict=True)]
    curve = record(
        "cp_tokens_per_rank",
        f"Context parallelism: Llama ({args.layers} layers, hidden {args.hidden}), "
        f"batch {args.batch}",
        ("sequence length (tokens)", "log"), ("training tokens/s per rank", "log"),
        [{"name": f"cp={cp} ({cp} process{'es' if cp > 1 else ''})",
          "points": [[p["seq"], round(p["tokens_per_s_per_rank"], 1)] for p in per_cp[cp]],
          "spread": [[round(q, 1) for q in p["iqr"]] for p in per_cp[cp]]} for cp in (1, 2)],
        [{"name": "cp2 / cp1 per rank (ratio)", "points": ratio}],
        derived_label="cp2 / cp1 per rank",
        points=[{"seq": p1["seq"], "cp1_step_ms": round(p1["step_ms"], 2),
                 "cp2_step_ms": round(p2["step_ms"], 2),
                 "cp1_tokens_per_s_per_rank": round(p1["tokens_per_s_per_rank"], 1),
                 "cp2_tokens_per_s_per_rank": round(p2["tokens_per_s_per_rank"], 1),
                 "cp2_over_cp1": r[1]}
                for p1, p2, r in zip(per_cp[1], per_cp[2], ratio, strict=True)],
        setup={"batch": args.batch, "hidden": args.hidden, "layers": args.layers,
               "windows": args.windows, "steps": args.steps, "cp_method": "alltoall"},
    )
    write([curve], args.json_out)


if __name__ == "__main__":
    main()
