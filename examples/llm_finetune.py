"""Fine-tune a causal language model from transformers with FSDP, bf16 and checkpoints.

Run on 2 CPU processes (a tiny Llama, in well under a minute):
    accel launch --nproc-per-node 2 --cpu examples/llm_finetune.py --output-dir llm_run
Stop it (SIGTERM or Ctrl-C to `accel launch`): every rank saves a checkpoint at the same step
and exits 0. Continue from the newest checkpoint, here on one process (twice the accumulation
keeps the global batch of 2 processes x 2 micro-batches):
    python examples/llm_finetune.py --output-dir llm_run --resume --grad-accum 4
Then load the result with plain transformers:
    AutoModelForCausalLM.from_pretrained("llm_run/final")

The model is built from a transformers config (nothing is downloaded): `--model-type llama`
(the default) or `gpt2`, any size by `--hidden-size`, `--layers`, `--heads`. The tokenizer
is byte-level (token = UTF-8 byte, 256 ids), so any text file works as `--train-file`; the
text is cut into blocks of `--block-size` tokens, the last tenth held out for evaluation.
What it uses of accel, marked `# accel:` below:

- FSDP2 (`strategy="fsdp"`): each decoder layer is a sharding unit, the parameters,
  gradients and AdamW moments are split across the processes;
- bf16 mixed precision (fp32 master weights), gradient accumulation, clipping over all shards;
- HF gradient checkpointing (`gradient_checkpointing_enable()`), applied before sharding;
- eval perplexity over exactly the held-out blocks with `gather_for_metrics`;
- `save_state` every `--save-every` steps (numbered, the newest `--total-limit` kept) and on
  `stop_requested()`; `--resume` with `load_state`, which puts the model, AdamW, the schedule
  and the data loader's position back (the batches already seen are not replayed);
- a greedy sample from the trained model (`generate`, run on every process under FSDP);
- the final weights as a transformers model directory (the no_trainer pattern:
  `save_pretrained` with the full state dict from `get_state_dict`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    get_cosine_schedule_with_warmup,
)

import accel

VOCAB = 256  # byte-level tokens
DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


def encode(text: str) -> torch.Tensor:
    """Byte-level tokenizer: one token per UTF-8 byte."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def make_blocks(path: Path, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus as non-overlapping ``block_size`` token blocks: (train, eval) = 90% / 10%."""
    tokens = encode(path.read_text(encoding="utf-8"))
    blocks = tokens[: len(tokens) // block_size * block_size].view(-1, block_size)
    n_eval = max(1, len(blocks) // 10)
    return blocks[:-n_eval], blocks[-n_eval:]


def make_config(args: argparse.Namespace) -> PretrainedConfig:
    """A transformers config from the flags (no dropout: a tiny model needs none)."""
    if args.model_type == "llama":
        return LlamaConfig(
            vocab_size=VOCAB, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
            intermediate_size=args.intermediate_size or 4 * args.hidden_size,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or args.heads,
            max_position_embeddings=args.block_size, tie_word_embeddings=args.tie_word_embeddings,
            bos_token_id=None, eos_token_id=None, use_cache=False,
        )
    return GPT2Config(
        vocab_size=VOCAB, n_embd=args.hidden_size, n_layer=args.layers, n_head=args.heads,
        n_inner=args.intermediate_size, n_positions=args.block_size,
        tie_word_embeddings=args.tie_word_embeddings, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, use_cache=False,
    )


def enable_checkpointing(model: PreTrainedModel) -> None:
    """HF gradient checkpointing: each decoder layer recomputes its activations in backward.

    transformers 5.24 renamed ``gradient_checkpointing_enable`` (still there, deprecated) to
    ``activation_checkpointing_enable``; either takes torch's checkpoint options.
    """
    options = {"use_reentrant": False}  # the non-reentrant form is the one FSDP2 supports
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def make_optimizer(model: PreTrainedModel, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with the usual two groups: no weight decay on biases and norm weights."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def evaluate(model: torch.nn.Module, loader: DataLoader[torch.Tensor]) -> float:
    """Mean next-token loss over every held-out block (every rank calls it)."""
    model.eval()
    losses = []
    with torch.no_grad():
        for batch in loader:
            logits = model(input_ids=batch).logits
            per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                        batch[:, 1:].flatten(), reduction="none")
            per_block = per_token.view(len(batch), -1).mean(dim=1)
            # accel: every rank's blocks, each held-out block exactly once
            losses.append(accel.gather_for_metrics(per_block))
    model.train()
    return torch.cat(losses).mean().item()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-file", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--output-dir", type=Path, default=Path("llm_finetune_run"))
    p.add_argument("--model-type", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="llama: grouped-query attention")
    p.add_argument("--intermediate-size", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--tie-word-embeddings", action="store_true",
                   help="share the input embedding with the output head")
    p.add_argument("--block-size", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process and batch")
    p.add_argument("--grad-accum", type=int, default=2, help="batches per optimizer step")
    p.add_argument("--max-steps", type=int, default=40, help="optimizer steps in all")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="bf16")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--eval-every", type=int, default=10, help="steps; 0: at the end only")
    p.add_argument("--save-every", type=int, default=10,
                   help="steps between checkpoints; 0: only when stopped")
    p.add_argument("--total-limit", type=int, default=2, help="checkpoints kept")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from CHECKPOINT, or from the newest one under "
                        "OUTPUT_DIR/checkpoints when no path is given (if there is one)")
    p.add_argument("--prompt", default="The keeper", help="text the final model continues")
    p.add_argument("--sample-tokens", type=int, default=48, help="0: no sample")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    checkpoints = args.output_dir / "checkpoints"
    # accel: FSDP2 + bf16 + accumulation for everything prepared in this block
    with accel.distributed(strategy="fsdp", mixed_precision=args.mixed_precision,
                           gradient_accumulation_steps=args.grad_accum, seed=args.seed):
        world = accel.state().world_size
        train_blocks, eval_blocks = make_blocks(args.train_file, args.block_size)
        # Every optimizer step sees a full global batch: drop the blocks that do not fill one.
        global_batch = args.batch_size * world * args.grad_accum
        train_blocks = train_blocks[: len(train_blocks) // global_batch * global_batch]
        if len(train_blocks) == 0:
            raise SystemExit(f"{args.train_file} holds fewer than {global_batch} blocks of "
                             f"{args.block_size} tokens: use a longer file or smaller sizes")

        model = AutoModelForCausalLM.from_config(make_config(args))
        if args.gradient_checkpointing:  # HF's own, before sharding; non-reentrant for FSDP
            enable_checkpointing(model)
        optimizer = make_optimizer(model, args.lr, args.weight_decay)
        train_loader = DataLoader(train_blocks, batch_size=args.batch_size, shuffle=True)
        eval_loader = DataLoader(eval_blocks, batch_size=args.batch_size)
        # accel: shards the model (one unit per decoder layer), points the optimizer at the
        # shards, and gives each process its share of the batches, on its device
        model, optimizer, train_loader, eval_loader = accel.prepare(
            model, optimizer, train_loader, eval_loader)
        # The schedule counts optimizer steps. It is not prepared: a prepared scheduler
        # advances world_size steps per optimizer step (Accelerate's rule), and this one must
        # read the same when the run is resumed on another number of processes.
        scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                   "train_loader": train_loader}
        accel.print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters())} "
                    f"parameters; {len(train_blocks)} train / {len(eval_blocks)} eval blocks of "
                    f"{args.block_size} tokens; global batch {global_batch} "
                    f"({world} x {args.batch_size} sequences x {args.grad_accum} accumulation)")

        step = 0
        if args.resume is not None:
            # accel: model shards (re-cut for this number of processes), AdamW moments, the
            # schedule and the loader's position all come back
            latest = args.resume == "latest"
            info = accel.load_state(checkpoints if latest else args.resume,
                                    missing_ok=latest, **objects)
            if info is None:
                accel.print(f"no checkpoint under {checkpoints}: starting from step 0")
            else:
                step = info.step or 0
                accel.print(f"resumed from step {step} ({info.path.name}, saved on "
                            f"{info.world_size} processes, running on {world})")

        stopped = False
        micro_losses: list[torch.Tensor] = []
        while step < args.max_steps and not stopped:
            for batch in train_loader:
                with accel.accumulate(model) as sync:  # accel: no gradient sync until the last
                    loss = model(input_ids=batch, labels=batch).loss
                    accel.backward(loss)  # accel: divided by the accumulation steps
                    accel.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()  # accel: a no-op until the accumulation step
                    optimizer.zero_grad()
                micro_losses.append(loss.detach())
                if not sync:
                    continue
                if not accel.optimizer_step_was_skipped(optimizer):  # fp16 overflow
                    scheduler.step()
                step += 1
                # accel: the step's loss averaged over its batches on every process
                step_loss = accel.reduce(torch.stack(micro_losses).mean(), "mean").item()
                micro_losses.clear()
                lr = scheduler.get_last_lr()[0]
                accel.print(f"step {step} loss {step_loss:.6f} lr {lr:.3e}", flush=True)
                if args.eval_every and step % args.eval_every == 0 and step < args.max_steps:
                    eval_loss = evaluate(model, eval_loader)
                    accel.print(f"eval loss {eval_loss:.6f} perplexity {math.exp(eval_loss):.4f} "
                                f"at step {step}", flush=True)
                stop = accel.stop_requested()  # accel: the same answer on every rank
                if stop or (args.save_every and step % args.save_every == 0):
                    # accel: every rank writes its own shards; the newest total_limit are kept
                    path = accel.save_state(checkpoints, step=step, total_limit=args.total_limit,
                                            **objects)
                    accel.print(f"saved {path}", flush=True)
                if stop:
                    accel.print(f"stop requested: saved step {step}, exiting", flush=True)
                    stopped = True
                    break
                if step >= args.max_steps:
                    break
        if stopped:
            return

        eval_loss = evaluate(model, eval_loader)
        accel.print(f"eval loss {eval_loss:.6f} perplexity {math.exp(eval_loss):.4f} "
                    f"at step {step}", flush=True)
        if args.sample_tokens:  # greedy; under FSDP every process runs every forward
            prompt = encode(args.prompt).unsqueeze(0).to(accel.state().device)
            model.eval()
            with torch.no_grad():
                sample = model.generate(prompt, max_new_tokens=args.sample_tokens,
                                        do_sample=False)
            accel.print(f"sample: {decode(sample[0])!r}", flush=True)
        final = args.output_dir / "final"
        # accel: the full weights (gathered from the shards, every rank takes part), written
        # by the main process in the transformers layout next to config.json
        state_dict = accel.get_state_dict(model)
        accel.unwrap_model(model).save_pretrained(
            final, is_main_process=accel.state().is_main_process, state_dict=state_dict)
        accel.wait_for_everyone()
        accel.print(f"finished at step {step}; load the model with "
                    f"AutoModelForCausalLM.from_pretrained({str(final)!r})", flush=True)


if __name__ == "__main__":
    main()
