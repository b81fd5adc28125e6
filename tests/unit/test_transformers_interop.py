"""save_model output loads with transformers' from_pretrained (skipped without transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import accel

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("shard", ["10GB", "20KB"])
def test_from_pretrained_reads_save_model_output(tmp_path: Path, shard: str) -> None:
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    model.config.save_pretrained(tmp_path)
    accel.save_model(model, tmp_path, max_shard_size=shard)
    loaded = transformers.BertModel.from_pretrained(tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
