"""init_empty_weights / init_on_device: parameters on meta (or the device) without memory."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.big_model import init as init_module
from accel.big_model.init import init_empty_weights, init_on_device
from accel.errors import DeviceMapError

ORIGINAL_REGISTER_PARAMETER = nn.Module.register_parameter
ORIGINAL_REGISTER_BUFFER = nn.Module.register_buffer


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _patch_removed() -> bool:
    return (
        nn.Module.register_parameter is ORIGINAL_REGISTER_PARAMETER
        and nn.Module.register_buffer is ORIGINAL_REGISTER_BUFFER
    )


class Tagged(nn.Parameter):
    """A Parameter subclass, as quantization libraries define them."""


class Custom(nn.Module):
    """Parameters made every way modules make them, and buffers of every kind."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.w = nn.Parameter(torch.randn(3, 3))
        self.register_parameter("frozen", nn.Parameter(torch.ones(2), requires_grad=False))
        self.tagged = Tagged(torch.zeros(5))
        self.nested = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
        self.register_buffer("pos", torch.arange(7))
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)), persistent=False)
        self.scale = nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.fill_(2.0)
            self.w.normal_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.emb(ids)) * self.scale
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        y = self.nested(x).sum() + self.w.sum() + self.frozen.sum() + self.tagged.sum()
        return y + self.pos.sum() + self.mask.sum()


def _param_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def test_every_kind_of_parameter_is_meta_and_keeps_its_class_and_requires_grad() -> None:
    with init_empty_weights():
        model = Custom()
        model.later = nn.Parameter(torch.ones(3))  # assigned after construction, in the block
    params = dict(model.named_parameters())
    assert set(params) == set(_param_names(Custom())) | {"later"}
    assert all(p.is_meta for p in params.values())
    assert all(isinstance(p, nn.Parameter) for p in params.values())
    assert type(params["tagged"]) is Tagged
    assert params["frozen"].requires_grad is False
    assert all(p.requires_grad for n, p in params.items() if n != "frozen")
    assert params["lin.weight"].shape == (4, 6) and params["emb.weight"].shape == (10, 4)
    assert params["lin.weight"].dtype == torch.float32


def test_buffers_keep_their_real_values_by_default() -> None:
    with init_empty_weights():
        model = Custom()
    reference = Custom()
    for (name, buffer), (_, expected) in zip(
        model.named_buffers(), reference.named_buffers(), strict=True
    ):
        assert buffer.device.type == "cpu", name
        assert torch.equal(buffer, expected), name
    assert torch.equal(model.pos, torch.arange(7))
    assert torch.equal(model.mask, torch.tril(torch.ones(3, 3)))


def test_include_buffers_puts_buffers_on_meta_too() -> None:
    with init_empty_weights(include_buffers=True):
        model = Custom()
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"pos", "mask", "bn.running_mean", "bn.running_var",
                            "bn.num_batches_tracked"}
    assert all(b.is_meta for b in buffers.values())
    assert buffers["pos"].shape == (7,) and buffers["pos"].dtype == torch.int64
    assert all(p.is_meta for p in model.parameters())
    # every factory without a device goes to meta, small or large, of any kind
    with init_empty_weights(include_buffers=True):
        made = [torch.zeros(3), torch.ones(2), torch.full((2,), 1.0), torch.empty(1),
                torch.randn(2), torch.normal(torch.zeros(2), torch.ones(2))]
    assert all(t.is_meta for t in made)


def test_forty_gigabytes_of_parameters_are_never_allocated() -> None:
    before = _rss()
    with init_empty_weights():
        model = nn.Sequential(*[nn.Linear(32768, 32768) for _ in range(10)])
        # a single weight bigger than this machine's memory (160 GB), made by a custom module
        huge = nn.Module()
        huge.w = nn.Parameter(torch.randn(200_000, 200_000))
    grown = _rss() - before
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert total > 40 * 10**9
    assert all(p.is_meta for p in model.parameters()) and huge.w.is_meta
    assert huge.w.shape == (200_000, 200_000)
    assert grown < 200 * 2**20, f"building grew the resident memory by {grown} bytes"


def test_large_factory_results_in_the_block_go_to_the_device_only_when_value_free() -> None:
    n = 5000  # 100 MB of float32: above the size where value-free factories are redirected
    with init_empty_weights():
        empty, rand = torch.empty(n, n), torch.rand((n, n))
        ones = torch.ones(n, n, dtype=torch.bool)  # e.g. a causal mask: its values matter
        small = torch.empty(4)
        holder = nn.Module()
        holder.register_buffer("causal", torch.tril(ones))
    assert empty.is_meta and rand.is_meta
    assert not ones.is_meta and bool(ones.all())
    assert not small.is_meta
    assert holder.causal.device.type == "cpu" and bool(holder.causal[-1].all())


def test_explicit_device_arguments_are_left_alone() -> None:
    with init_empty_weights():
        layer = nn.Linear(3, 3, device="cpu")
        tensor = torch.zeros(3, device="cpu")
    # the parameter is registered inside the block, so it goes to meta like any other
    assert layer.weight.is_meta
    assert tensor.device.type == "cpu"


def test_a_meta_built_model_loads_weights_and_matches_the_full_model() -> None:
    torch.manual_seed(0)
    full = Custom().eval()
    with init_empty_weights():
        empty = Custom().eval()
    empty.load_state_dict(full.state_dict(), assign=True)
    ids = torch.randint(0, 10, (2, 5))
    assert not any(p.is_meta for p in empty.parameters())
    torch.testing.assert_close(empty(ids), full(ids), atol=1e-6, rtol=0)


def test_ties_made_inside_the_block_stay_tied() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

    with init_empty_weights():
        model = Tied()
    assert model.head.weight is model.embed.weight and model.head.weight.is_meta
    assert len(list(model.parameters())) == 1


def test_parameter_attributes_survive_the_move() -> None:
    class Quantized(nn.Parameter):
        def __new__(
            cls, data: torch.Tensor, requires_grad: bool = False, bits: int = 8
        ) -> Quantized:
            param = super().__new__(cls, data, requires_grad)
            param.bits = bits
            return param

    plain = nn.Parameter(torch.ones(2))
    plain.no_decay = True  # set before registration: a plain Parameter takes no kwargs
    with init_empty_weights():
        holder = nn.Module()
        holder.q = Quantized(torch.ones(3), bits=4)
        holder.p = plain
    assert type(holder.q) is Quantized and holder.q.bits == 4 and holder.q.is_meta
    assert holder.q.requires_grad is False
    assert holder.p.is_meta and holder.p.no_decay is True and holder.p.requires_grad


def test_init_on_device_cpu_gives_real_initialised_parameters() -> None:
    torch.manual_seed(3)
    expected = nn.Linear(5, 5)
    torch.manual_seed(3)
    with init_on_device("cpu"):
        layer = nn.Linear(5, 5)
    assert torch.equal(layer.weight, expected.weight)
    assert torch.equal(layer.bias, expected.bias)
    with accel.init_on_device(torch.device("meta"), include_buffers=True):
        bn = nn.BatchNorm1d(3)
    assert bn.weight.is_meta and bn.running_mean.is_meta


def test_nesting_the_innermost_block_wins_and_the_outer_comes_back() -> None:
    with init_empty_weights():
        outer_before = nn.Linear(2, 2)
        with init_on_device("cpu"):
            inner = nn.Linear(2, 2)
            inner_big = torch.empty(5000, 5000)  # large: the inner block's device, not meta
        outer_after = nn.Linear(2, 2)
        with init_empty_weights(include_buffers=True):
            inner_bn = nn.BatchNorm1d(2)
        outer_bn = nn.BatchNorm1d(2)
    after = nn.Linear(2, 2)
    assert outer_before.weight.is_meta and outer_after.weight.is_meta
    assert inner.weight.device.type == "cpu" and not inner_big.is_meta
    assert inner_bn.running_mean.is_meta
    assert outer_bn.weight.is_meta and outer_bn.running_mean.device.type == "cpu"
    assert after.weight.device.type == "cpu"
    assert _patch_removed()


def _build_then_fail() -> None:
    with init_empty_weights(include_buffers=True):
        nn.Linear(2, 2)
        raise RuntimeError("boom")


def test_everything_is_restored_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _build_then_fail()
    assert _patch_removed()
    layer = nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu"
    assert torch.empty(5000, 5000).device.type == "cpu"
    assert torch.zeros(2).device.type == "cpu"


def test_other_threads_build_real_modules_while_a_block_is_open() -> None:
    entered, built, leave = threading.Event(), threading.Event(), threading.Event()
    results: dict[str, Any] = {}

    def worker() -> None:
        with init_empty_weights():
            entered.set()
            built.wait(10)
            results["worker"] = nn.Linear(3, 3)
            leave.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert entered.wait(10)
        results["main"] = nn.Linear(3, 3)  # built while the worker's block is open
        results["main_big"] = torch.empty(5000, 5000)
        built.set()
    finally:
        leave.set()
        thread.join(10)
    assert results["main"].weight.device.type == "cpu"
    assert not results["main_big"].is_meta
    assert results["worker"].weight.is_meta
    assert _patch_removed()


def test_blocks_closing_out_of_order_across_threads_leave_no_patch() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with init_empty_weights():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with init_empty_weights():
            second_in.set()
            first_out.wait(10)  # the first thread's block closes while this one is open
            assert nn.Linear(2, 2).weight.is_meta

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert _patch_removed()
    assert init_module._active == 0
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_a_patch_made_over_ours_is_left_in_place() -> None:
    def theirs(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        ORIGINAL_REGISTER_PARAMETER(self, name, param)

    try:
        with init_empty_weights():
            nn.Module.register_parameter = theirs  # type: ignore[method-assign]
        assert nn.Module.register_parameter is theirs
    finally:
        nn.Module.register_parameter = ORIGINAL_REGISTER_PARAMETER  # type: ignore[method-assign]


def test_a_bad_device_is_refused_before_anything_is_patched() -> None:
    for bad in ("nowhere", 1.5, None):
        context = init_on_device(bad)  # type: ignore[arg-type]
        with pytest.raises(DeviceMapError, match=rf"device={bad!r}, which is not a device"):
            context.__enter__()
    assert _patch_removed() and init_module._active == 0


def test_a_single_forty_gigabyte_linear_builds_on_meta() -> None:
    # 100,000 x 100,000 float32 is 40 GB: more than this machine's memory, so it could not be
    # allocated outside the block
    with accel.init_empty_weights():
        layer = nn.Linear(100_000, 100_000)
    assert layer.weight.is_meta and layer.bias.is_meta
    assert layer.weight.shape == (100_000, 100_000) and layer.weight.dtype == torch.float32
    assert layer.weight.numel() * layer.weight.element_size() == 40 * 10**9


def test_public_names_are_the_same_functions() -> None:
    assert accel.init_empty_weights is init_empty_weights
    assert accel.init_on_device is init_on_device
    with accel.init_empty_weights():
        layer = nn.Linear(4, 4)
        embedding = nn.Embedding(8, 4)
        norm = nn.LayerNorm(4)
    assert all(p.is_meta for m in (layer, embedding, norm) for p in m.parameters())
    assert nn.Linear(4, 4).weight.device.type == "cpu"  # outside the block: normal again
