"""Bodies of the context-parallel tests (run on gloo ranks by ``accel.testing.run_distributed``).

A tiny causal Llama (8 heads, 4 key/value heads, RoPE) trains on the same global batches on
any mesh; :func:`train` returns what the tests compare with one process: each step's global
loss, the full weights after the steps, and the last-token predictions of the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import accel

SEQ = 12
BATCH = 4  # the global batch (split between the data-parallel ranks only)
STEPS = 3


def llama(heads: int = 8, kv_heads: int = 4) -> nn.Module:
    """A two-layer causal Llama built locally (no download), eager attention, seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        use_cache=False, attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def gpt2() -> nn.Module:
    """A two-layer GPT-2 (learned positions, Conv1D layers, tied head) built locally."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        attn_implementation="eager")
    return GPT2LMHeadModel(config)


def batches(steps: int = STEPS, seq: int = SEQ) -> list[dict[str, torch.Tensor]]:
    """Global batches: labels with some -100 targets (uneven over the sequence pieces)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (BATCH, seq), generator=g)
        labels = ids.clone()
        labels[:, : seq // 3] = -100  # a prompt without targets: rank 0's piece has fewer
        labels[0, -2:] = -100
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def train(steps: int = STEPS, save: str | None = None, load: str | None = None,
          seq: int = SEQ, start: int = 0, family: str = "llama") -> dict[str, Any]:
    """AdamW steps on this rank's share of global batches ``start..start+steps`` (the plain
    loop); optionally load before / save after."""
    st = accel.state()
    model = accel.prepare_model(gpt2() if family == "gpt2" else llama())
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    if load is not None:
        accel.load_state(load, model=model, optimizer=optimizer)
    attn_in_block = accel.unwrap_model(model).config._attn_implementation
    rows = [{k: v[i] for k, v in b.items()} for b in batches(start + steps, seq)[start:]
            for i in range(BATCH)]  # samples as dicts: the loader collates dict batches
    loader = accel.prepare_data_loader(
        torch.utils.data.DataLoader(rows, batch_size=BATCH), split_batches=True)
    losses = []
    for batch in loader:  # this rank's rows of each global batch, whole sequences
        loss = model(**batch).loss
        accel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accel.reduce(loss.detach(), reduction="mean")))
    if save is not None:
        accel.save_state(save, model=model, optimizer=optimizer)
    per_rank = BATCH // st.dp_world_size
    with torch.no_grad():
        ids = batches(1, seq)[0]["input_ids"][st.dp_rank * per_rank:(st.dp_rank + 1) * per_rank]
        last = accel.gather_for_metrics(model(input_ids=ids).logits[:, -1])
    weights = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    return {"losses": losses, "weights": weights if st.is_main_process else None,
            "last": last, "cp": (st.cp_rank, st.cp_world_size), "dp": (st.dp_rank,
            st.dp_world_size), "mesh": st.mesh_shape,
            "attn": attn_in_block}


def attention(causal: bool, heads: int, kv_heads: int) -> dict[str, Any]:
    """All-to-all attention on this rank's piece vs full SDPA on the whole sequence."""
    from accel.parallel.context_parallel import gather_sequence, sequence_parallel_attention

    st = accel.state()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 8, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, 8, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, 8, 4, generator=g, dtype=torch.float64)
    weights = torch.randn(2, heads, 8, 4, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        full[0], full[1].repeat_interleave(rep, 1), full[2].repeat_interleave(rep, 1),
        is_causal=causal)
    (want * weights).sum().backward()
    piece = 8 // st.cp_world_size
    mine = slice(st.cp_rank * piece, (st.cp_rank + 1) * piece)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = sequence_parallel_attention(*local, is_causal=causal)
    (out * weights[:, :, mine]).sum().backward()
    whole = gather_sequence(out.transpose(1, 2)).transpose(1, 2)
    return {"out": whole.detach(), "want": want.detach(),
            "grads": [t.grad for t in local], "want_grads": [t.grad[:, :, mine] for t in full]}


def refusals() -> list[str]:
    """The errors of a model whose heads cp does not divide and of an odd sequence length."""
    from accel.errors import ConfigError

    said = []
    try:
        accel.prepare_model(llama(heads=4, kv_heads=1))
    except ConfigError as exc:
        said.append(str(exc))
    model = accel.prepare_model(llama())
    try:
        model(input_ids=torch.zeros(1, 7, dtype=torch.long))
    except ConfigError as exc:
        said.append(str(exc))
    try:
        model(input_ids=torch.zeros(1, 8, dtype=torch.long),
              attention_mask=torch.tensor([[1] * 6 + [0] * 2]))
    except ConfigError as exc:
        said.append(str(exc))
    return said
