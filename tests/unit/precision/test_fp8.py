"""mixed_precision="fp8": torchao's float8 training of the nn.Linear layers, on CPU.

What is converted and what is kept (the rule, the filter option), the recipes and where they
come from (keyword, ACCEL_FP8_RECIPE, config file), the errors (an unknown recipe, torchao
missing), and training within fp8 tolerance of bf16 (an MLP and a tiny transformers Llama).
Checkpoints: test_fp8_checkpoint.py; FSDP2 and TP over processes:
tests/multiproc/test_fp8_multiproc.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.errors import ConfigError

float8 = pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

VOCAB = 96


class Tagger(nn.Module):
    """An embedding, two convertible layers, one of odd size, a Linear subclass, an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.odd = nn.Linear(32, 24)  # 24: not a multiple of 16
        self.sub = nn.modules.linear.NonDynamicallyQuantizableLinear(32, 32)  # a subclass
        self.head = nn.Linear(32, VOCAB)  # the vocabulary: the LM head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = self.sub(self.down(torch.relu(self.up(h))))
        return self.head(h) + self.odd(h).sum(-1, keepdim=True)


class MLP(nn.Module):
    """About 10k parameters; every layer convertible."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.hidden(torch.nn.functional.gelu(
            self.inp(x)))))


def _kinds(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, nn.Linear)}


def _granularity(module: nn.Module) -> str:
    return str(module.config.cast_config_input.scaling_granularity.value)


def test_prepare_converts_the_linear_layers_and_keeps_the_rest() -> None:
    torch.manual_seed(0)
    net = Tagger()
    params = dict(net.named_parameters())
    with accel.distributed(mixed_precision="fp8"):
        model = accel.prepare_model(net)
        assert _kinds(model) == {
            "up": "Float8Linear", "down": "Float8Linear", "odd": "Linear",
            "sub": "NonDynamicallyQuantizableLinear", "head": "Linear",
        }
        assert dict(model.named_parameters()) == params  # the same tensors: an optimizer
        out = model(torch.randint(0, VOCAB, (2, 5)))  # made before prepare still fits
        assert out.dtype == torch.float32 and out.shape == (2, 5, VOCAB)
        assert accel.prepare_model(net) is model  # converted once


def test_the_filter_option_replaces_the_lm_head_rule() -> None:
    def only_head(module: nn.Module, name: str) -> bool:
        return name == "head"

    with accel.distributed(mixed_precision="fp8", fp8_module_filter=only_head):
        model = accel.prepare_model(Tagger())
    assert _kinds(model)["head"] == "Float8Linear"
    assert _kinds(model)["up"] == _kinds(model)["odd"] == "Linear"


def test_a_model_without_a_convertible_layer_trains_as_bf16_and_says_so() -> None:
    with accel.distributed(mixed_precision="fp8"), pytest.warns(UserWarning, match="as bf16"):
        model = accel.prepare_model(nn.Sequential(nn.Linear(8, 8)))
    assert type(model[0]) is nn.Linear  # 8: not a multiple of 16
    root = nn.Linear(32, 32)
    with accel.distributed(mixed_precision="fp8"), pytest.warns(UserWarning, match="the root"):
        assert accel.prepare_model(root) is root  # the object the user holds stays itself
    assert type(root) is nn.Linear


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, "tensorwise"), ({"fp8_recipe": "rowwise"}, "axiswise"),
     ({"fp8_recipe": "TensorWise"}, "tensorwise")],
)
def test_recipes_by_keyword(given: dict[str, Any], expected: str) -> None:
    with accel.distributed(mixed_precision="fp8", **given) as st:
        model = accel.prepare_model(MLP())
        assert _granularity(model.inp) == expected
        assert st.options.get("fp8_recipe", "tensorwise").lower() in ("tensorwise", "rowwise")


def test_a_torchao_config_is_used_as_given() -> None:
    config = float8.Float8LinearConfig(emulate=True)
    with accel.distributed(mixed_precision="fp8", fp8_recipe=config):
        model = accel.prepare_model(MLP())
    assert isinstance(model.inp, Float8Linear) and model.inp.config is config
    gathering = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    with accel.distributed(mixed_precision="fp8", fp8_recipe=gathering):  # no FSDP2 here
        model = accel.prepare_model(MLP())
    assert not model.inp.config.enable_fsdp_float8_all_gather
    assert type(model.inp.weight.data) is torch.Tensor  # plain weights, plain state dicts


def test_recipe_from_the_environment_and_the_config_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ACCEL_FP8_RECIPE", "rowwise")
    with accel.distributed(mixed_precision="fp8") as st:
        assert st.options["fp8_recipe"] == "rowwise"
        assert _granularity(accel.prepare_model(MLP()).inp) == "axiswise"
    monkeypatch.delenv("ACCEL_FP8_RECIPE")
    config = tmp_path / "accel.toml"
    config.write_text('mixed_precision = "fp8"\nfp8_recipe = "rowwise"\n')
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(config))
    with accel.distributed() as st:
        assert (st.mixed_precision, st.options["fp8_recipe"]) == ("fp8", "rowwise")
        assert _granularity(accel.prepare_model(MLP()).hidden) == "axiswise"


@pytest.mark.parametrize(
    ("options", "match"),
    [({"fp8_recipe": "blockwise"}, r"fp8_recipe='blockwise'.*\['tensorwise', 'rowwise'\]"),
     ({"fp8_recipe": 3}, r"\['tensorwise', 'rowwise'\]"),
     ({"fp8_recipie": "rowwise"}, "did you mean 'fp8_recipe'"),
     ({"fp8_module_filter": "head"}, "fp8_module_filter='head' is not callable")],
)
def test_bad_fp8_options_are_config_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match), accel.distributed(
        mixed_precision="fp8", **options
    ):
        pass


def test_a_bad_recipe_in_the_environment_names_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_FP8_RECIPE", "delayed")
    match = r"ACCEL_FP8_RECIPE='delayed'.*'tensorwise', 'rowwise'"
    with pytest.raises(ConfigError, match=match), accel.distributed(mixed_precision="fp8"):
        pass


def test_without_torchao_prepare_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # `import torchao...` now fails
    net = MLP()
    with accel.distributed(mixed_precision="fp8"), pytest.raises(ConfigError) as info:
        accel.prepare_model(net)
    assert "`pip install 'accel[fp8]'`" in str(info.value)
    assert type(net.inp) is nn.Linear  # nothing changed
    with accel.distributed(mixed_precision="bf16"):  # other modes do not need it
        accel.prepare_model(MLP())


def test_import_accel_does_not_import_torchao() -> None:
    code = (
        "import sys, torch, accel\n"
        "import accel.training.model, accel.precision.registry, accel.core.options\n"
        "with accel.distributed(mixed_precision='bf16'):\n"
        "    accel.prepare_model(torch.nn.Sequential(torch.nn.Linear(16, 16)))\n"
        "assert 'torchao' not in sys.modules, 'torchao imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def _train(mode: str, make: Callable[[], nn.Module], batches: list[Any],
           loss_fn: Callable[[nn.Module, Any], torch.Tensor],
           lr: float = 1e-2) -> tuple[list[float], nn.Module]:
    torch.manual_seed(0)
    net = make()
    with accel.distributed(mixed_precision=mode):
        model = accel.prepare_model(net)
        optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=lr))
        losses = []
        for batch in batches:
            loss = loss_fn(model, batch)
            accel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses, net


def test_an_mlp_trains_within_fp8_tolerance_of_bf16() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 32, generator=g), torch.randn(32, 16, generator=g))
               for _ in range(5)]

    def mse(model: nn.Module, batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    bf16, _ = _train("bf16", MLP, batches, mse)
    fp8, net = _train("fp8", MLP, batches, mse)
    assert all(isinstance(m, Float8Linear) for m in (net.inp, net.hidden, net.out))
    assert fp8[-1] < fp8[0]
    assert fp8 == pytest.approx(bf16, rel=0.03)
    assert fp8 != bf16  # really computed otherwise


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def test_a_tiny_llama_trains_within_fp8_tolerance_of_bf16() -> None:
    pytest.importorskip("transformers")
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))

    def lm(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]

    bf16, _ = _train("bf16", _llama, [ids] * 5, lm, lr=3e-3)  # one batch, learnt by heart
    fp8, net = _train("fp8", _llama, [ids] * 5, lm, lr=3e-3)
    kinds = _kinds(net)
    assert kinds.pop("lm_head") == "Linear"  # the LM head stays in bf16
    assert set(kinds.values()) == {"Float8Linear"} and len(kinds) == 14  # q k v o gate up down
    assert fp8[-1] < fp8[0]
    assert fp8 == pytest.approx(bf16, rel=0.03)


def test_float8_tp_styles_only_for_tensorwise_float8_layers() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    from accel.precision.registry import precision_for

    plan = {"inp": ColwiseParallel(), "hidden": RowwiseParallel(), "out": ColwiseParallel()}
    with accel.distributed(mixed_precision="fp8", fp8_module_filter=lambda m, n: n != "out"):
        model = accel.prepare_model(MLP())
        styles = precision_for("fp8").parallel_styles(model, plan)
    assert type(styles["inp"]) is Float8ColwiseParallel
    assert type(styles["hidden"]).__name__ == "Float8RowwiseParallel"
    assert styles["out"] is plan["out"]  # not a float8 layer
    with accel.distributed(mixed_precision="fp8", fp8_recipe="rowwise"):
        rowwise = accel.prepare_model(MLP())
        assert precision_for("fp8").parallel_styles(rowwise, plan) == plan  # torchao's: tensorwise
    assert precision_for("bf16").parallel_styles(model, plan) == plan
