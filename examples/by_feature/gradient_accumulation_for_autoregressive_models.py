"""Gradient accumulation for language models: normalise by the tokens of the whole step.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu \
        examples/by_feature/gradient_accumulation_for_autoregressive_models.py \
        --gradient-accumulation-steps 3

Sequences have different numbers of real tokens (padding is labelled -100), so averaging
each batch's mean loss weighs tokens of short batches more than those of long ones. The
large-batch loss is the sum over all tokens of the optimizer step divided by their number,
counted over the ``k`` batches of the step and over every rank. The loop therefore takes the
``k`` batches of a step first, all-reduces their token count, and backpropagates
``sum_loss / total_tokens * world_size`` for each (DDP averages the ranks' gradients, hence
``* world_size``), syncing gradients only on the step's last batch. Every rank also trains a
plain copy on the gathered large batches; the script prints the largest weight difference.
Lines that differ from a plain loop are marked ``# accel:``. Synthetic data, no download.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel

VOCAB, LENGTH = 16, 12


def make_sequences(n: int, seed: int) -> TensorDataset:
    """Token ``t+1`` is ``(3 * token_t + 1) % VOCAB`` most of the time; random lengths."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(n, LENGTH + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(LENGTH):
        noise = torch.randint(0, VOCAB, (n,), generator=g)
        keep = torch.rand(n, generator=g) < 0.8
        tokens[:, t + 1] = torch.where(keep, (3 * tokens[:, t] + 1) % VOCAB, noise)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    padding = torch.arange(LENGTH)[None, :] >= lengths[:, None]
    labels[padding] = -100  # ignored by the loss
    inputs[padding] = 0
    return TensorDataset(inputs, labels)


class TinyLM(nn.Module):
    """Embedding, a GRU and a projection to the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = nn.GRU(16, 32, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    args = parser.parse_args()
    k = args.gradient_accumulation_steps

    # accel: gradient_accumulation_steps stays 1 here: the loop groups the batches itself,
    # so accel.backward does not divide the loss
    with accel.distributed(seed=0):
        world_size = accel.state().world_size
        model = TinyLM()
        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        train = DataLoader(make_sequences(104, 1), batch_size=args.batch_size, shuffle=True)
        valid = DataLoader(make_sequences(37, 2), batch_size=args.batch_size)
        model, optimizer, train, valid = accel.prepare(model, optimizer, train, valid)
        updates_per_epoch = math.ceil(len(train) / k)

        for epoch in range(args.epochs):
            model.train()
            batches = iter(train)
            for update in range(updates_per_epoch):
                group = list(itertools.islice(batches, k))  # the last may be shorter
                local_tokens = sum(int((labels != -100).sum()) for _, labels in group)
                # accel: the token count of the whole step, over every rank
                total_tokens = int(accel.reduce(torch.tensor(local_tokens), "sum"))
                step_loss = 0.0
                for i, (inputs, labels) in enumerate(group):
                    last = i == len(group) - 1
                    # accel: no gradient all-reduce until the step's last batch
                    with contextlib.nullcontext() if last else accel.no_sync(model):
                        loss = token_loss_sum(model(inputs), labels) / total_tokens
                        accel.backward(loss * world_size)
                    step_loss += loss.item()
                accel.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()

                # the comparison: one large batch of every rank's sequences of this step
                big = accel.gather([torch.cat(t) for t in zip(*group, strict=True)])
                ref_loss = token_loss_sum(reference(big[0]), big[1]) / total_tokens
                ref_loss.backward()
                nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm)
                ref_optimizer.step()
                ref_optimizer.zero_grad()
                step_total = float(accel.reduce(torch.tensor(step_loss), "sum"))
                accel.print(f"epoch {epoch} update {update}: {total_tokens} tokens, "
                            f"loss {step_total:.4f} (large batch {ref_loss.item():.4f})")

            model.eval()
            loss_sum = torch.zeros(())
            tokens = 0
            with torch.no_grad():
                for inputs, labels in valid:
                    per_sequence = torch.stack([
                        token_loss_sum(model(inputs[j:j + 1]), labels[j:j + 1])
                        for j in range(len(inputs))
                    ])
                    counts = (labels != -100).sum(dim=1)
                    per_sequence, counts = accel.gather_for_metrics((per_sequence, counts))
                    loss_sum += per_sequence.sum()
                    tokens += int(counts.sum())
            in_dataset = int((valid.dataset.tensors[1] != -100).sum())
            accel.print(f"epoch {epoch}: eval perplexity {math.exp(loss_sum / tokens):.3f} "
                        f"over {tokens} tokens (the validation set has {in_dataset})")

        pairs = zip(accel.unwrap_model(model).parameters(), reference.parameters(), strict=True)
        difference = max((p - r).abs().max().item() for p, r in pairs)
        accel.print(f"max difference from the large batch: {difference:.3g}")


if __name__ == "__main__":
    main()
