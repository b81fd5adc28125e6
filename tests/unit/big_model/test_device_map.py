"""Device maps: budgets, the planner, balanced budgets, explicit maps.

Every expected map below was computed by HuggingFace Accelerate 1.15's
``infer_auto_device_map`` / ``get_balanced_memory`` on the same models and budgets and is
hard-coded here (these tests do not need Accelerate). Planning needs no GPU: budgets for GPU
indices 0 and 1 are enough.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.big_model import device_map as dm
from accel.big_model import model_walk
from accel.big_model._explicit_map import check_device_map, normalize_device
from accel.big_model.device_map import (
    get_balanced_memory,
    infer_auto_device_map,
    parse_max_memory,
    resolve_device_map,
)
from accel.errors import DeviceMapError

CPU = torch.device("cpu")


class Block(nn.Module):
    """A residual block: 2 x Linear(16, 16) = 2,176 bytes in float32."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)


class Net(nn.Module):
    """embed (2,048 B), blocks (4 x 2,176 B), head (2,048 B): 12,800 bytes in float32."""

    def __init__(self, d: int = 16, n: int = 4, vocab: int = 32, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.register_buffer("pos", torch.arange(64, dtype=torch.float32))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = WithBuffer()
        self.second = nn.Linear(16, 16)


@pytest.fixture
def net() -> Net:
    with accel.init_empty_weights():
        return Net()


# --- parse_max_memory -------------------------------------------------------------------


def test_parse_max_memory_sizes_and_keys() -> None:
    parsed = parse_max_memory(
        {"cpu": "1.5GB", "cuda:1": "200MB", 0: "10GiB", "disk": 7, 2: 2e9}
    )
    assert parsed == {0: 10 * 2**30, 1: 200_000_000, 2: 2_000_000_000, "cpu": 1_500_000_000,
                      "disk": 7}
    assert list(parsed) == [0, 1, 2, "cpu", "disk"]  # GPUs ascending, then cpu, then disk
    assert list(parse_max_memory({"disk": 1, "cpu": 2, 3: 3, 1: 4})) == [1, 3, "cpu", "disk"]
    assert parse_max_memory({torch.device("cuda", 1): "1KiB", torch.device("cpu"): "2 kb"}) == {
        1: 1024, "cpu": 2000}
    assert parse_max_memory({"cpu": "0"}) == {"cpu": 0}
    assert parse_max_memory({}) == {}  # a given mapping is taken as it is


def test_parse_max_memory_default_is_free_gpu_memory_and_ninety_percent_of_ram(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budgets = parse_max_memory(None)
    assert budgets["cpu"] > 0
    gpus = [k for k in budgets if k != "cpu"]
    expected_gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    assert gpus == expected_gpus
    assert list(budgets)[-1] == "cpu"
    monkeypatch.setattr(dm, "_available_ram", lambda: 1000)
    assert parse_max_memory(None)["cpu"] == 900


@pytest.mark.parametrize(
    "value", ["lots", "10 parsecs", "-5MB", "1.5.2GB", "", -1, -1.0, float("nan"),
              float("inf"), True, None, [1]]
)
def test_parse_max_memory_refuses_bad_sizes_naming_them(value: Any) -> None:
    with pytest.raises(DeviceMapError, match=r"is not a size") as info:
        parse_max_memory({"cpu": value})
    assert f"max_memory['cpu']={value!r}" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("key", ["gpu", "cuda:x", -1, True, 1.5, None, torch.device("meta")])
def test_parse_max_memory_refuses_bad_keys_naming_them(key: Any) -> None:
    with pytest.raises(DeviceMapError, match=r"keys are GPU indices") as info:
        parse_max_memory({key: 100})
    assert f"has the key {key!r}" in str(info.value)


@pytest.mark.parametrize("value", ["10GB", [("cpu", 10)], 5])
def test_parse_max_memory_refuses_a_non_mapping(value: Any) -> None:
    with pytest.raises(DeviceMapError, match=r"is not a mapping") as info:
        parse_max_memory(value)
    assert f"max_memory={value!r}" in str(info.value)


def test_a_bad_budget_reaches_the_user_through_every_entry_point(net: Net) -> None:
    for call in (infer_auto_device_map, get_balanced_memory, accel.infer_auto_device_map):
        with pytest.raises(DeviceMapError, match=r"max_memory\['cpu'\]='12 GiBs'"):
            call(net, max_memory={"cpu": "12 GiBs"})


# --- normalize_device -------------------------------------------------------------------


def test_normalize_device_good_values() -> None:
    assert normalize_device(0) == torch.device("cuda", 0)
    assert normalize_device(3) == torch.device("cuda", 3)
    assert normalize_device("cpu") == CPU
    assert normalize_device("cuda:1") == torch.device("cuda", 1)
    assert normalize_device("disk") == "disk"
    device = torch.device("cuda", 2)
    assert normalize_device(device) is device


@pytest.mark.parametrize("value", [-1, True, 1.5, None, "nowhere", "gpu0", ["cpu"]])
def test_normalize_device_refuses_bad_values_naming_them(value: Any) -> None:
    with pytest.raises(DeviceMapError, match=r"is not a device for a device map") as info:
        normalize_device(value)
    assert str(info.value).startswith(repr(value))


# --- infer_auto_device_map --------------------------------------------------------------


def test_everything_fits_on_the_cpu(net: Net) -> None:
    assert infer_auto_device_map(net, max_memory={"cpu": 10**6}) == {"": "cpu"}
    assert infer_auto_device_map(net, max_memory={"cpu": "1MB"}) == {"": "cpu"}
    # exactly the model's size: nothing is left to bring in, so no room need be kept
    assert infer_auto_device_map(net, max_memory={"cpu": 12_800}) == {"": "cpu"}


def test_a_model_bigger_than_the_cpu_budget_is_split_to_disk_in_module_order(net: Net) -> None:
    planned = infer_auto_device_map(net, max_memory={"cpu": 6000})
    # Accelerate 1.15: the same map, in the same order
    assert list(planned.items()) == [
        ("embed", "cpu"), ("blocks.0.fc1", "cpu"), ("blocks.0.fc2", "disk"),
        ("blocks.1", "disk"), ("blocks.2", "disk"), ("blocks.3", "disk"), ("head", "disk"),
    ]
    # one byte short of the whole model: the tail goes to disk
    assert infer_auto_device_map(net, max_memory={"cpu": 12_799}) == {
        "embed": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "cpu",
        "blocks.3.fc1": "cpu", "blocks.3.fc2": "disk", "head": "disk",
    }
    check_device_map(net, planned)  # the planner's maps pass the explicit-map check


def test_the_cpu_keeps_room_for_the_largest_layer(net: Net) -> None:
    # 11,000 bytes would hold embed + 4 blocks (10,752), but the cpu keeps room for the largest
    # layer still to come (a Block, 2,176 B) beside them: blocks.3 goes to disk (Accelerate 1.15)
    planned = infer_auto_device_map(net, max_memory={"cpu": 11_000},
                                    no_split_module_classes=[Block])
    assert planned == {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "cpu",
                       "blocks.2": "cpu", "blocks.3": "disk", "head": "disk"}
    used = sum(model_walk.module_sizes(net)[n] for n, d in planned.items() if d == "cpu")
    assert used + 2_176 <= 11_000 < used + 2_176 + 2_176


@pytest.mark.parametrize("no_split", [[Block], ["Block"], Block, "Block", (Block, "Other")])
def test_no_split_module_classes_never_splits_a_block(net: Net, no_split: Any) -> None:
    planned = infer_auto_device_map(net, max_memory={"cpu": 6000},
                                    no_split_module_classes=no_split)
    assert planned == {"embed": "cpu", "blocks": "disk", "head": "disk"}  # Accelerate 1.15
    planned = infer_auto_device_map(net, max_memory={"cpu": 6000}, dtype=torch.float16,
                                    no_split_module_classes=no_split)
    assert planned == {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "cpu",
                       "blocks.3": "disk", "head": "disk"}
    assert not any(name.count(".") > 1 for name in planned)  # no blocks.N.fcM entry
    # the same budget without no_split splits blocks.3
    assert "blocks.3.fc1" in infer_auto_device_map(net, max_memory={"cpu": 6000},
                                                   dtype=torch.float16)


def test_a_bad_no_split_entry_is_refused(net: Net) -> None:
    with pytest.raises(DeviceMapError, match=r"no_split_module_classes holds 5"):
        infer_auto_device_map(net, max_memory={"cpu": 6000}, no_split_module_classes=[5])  # type: ignore[list-item]


def test_tied_embedding_and_head_share_a_device() -> None:
    with accel.init_empty_weights():
        tied = Net(tied=True)
    assert tied.head.weight is tied.embed.weight
    # Accelerate 1.15: the head follows the embedding onto the cpu past the disk blocks
    assert infer_auto_device_map(tied, max_memory={"cpu": 5000}) == {
        "embed": "cpu", "blocks.0.fc1": "cpu", "blocks.0.fc2": "disk", "blocks.1": "disk",
        "blocks.2": "disk", "blocks.3": "disk", "head": "cpu",
    }
    assert infer_auto_device_map(tied, max_memory={"cpu": 4000}) == {
        "embed": "cpu", "blocks": "disk", "head": "cpu"}


def test_float16_fits_more(net: Net) -> None:
    fp32 = infer_auto_device_map(net, max_memory={"cpu": 6000})
    fp16 = infer_auto_device_map(net, max_memory={"cpu": 6000}, dtype=torch.float16)
    assert fp16 == {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "cpu",
                    "blocks.3.fc1": "cpu", "blocks.3.fc2": "disk", "head": "disk"}
    assert sum(d == "cpu" for d in fp16.values()) > sum(d == "cpu" for d in fp32.values())
    assert infer_auto_device_map(net, max_memory={"cpu": 6000}, dtype="float16") == fp16
    assert infer_auto_device_map(net, max_memory={"cpu": 6000}, dtype="torch.float16") == fp16
    # a larger dtype never counts floating weights bigger than they are
    assert infer_auto_device_map(net, max_memory={"cpu": 6000}, dtype=torch.float64) == fp32


@pytest.mark.parametrize("dtype", ["float17", "nn", 16])
def test_a_bad_dtype_is_refused(net: Net, dtype: Any) -> None:
    with pytest.raises(DeviceMapError, match=rf"dtype={dtype!r} is not a torch dtype"):
        infer_auto_device_map(net, max_memory={"cpu": 6000}, dtype=dtype)


def test_two_gpus_then_cpu_then_disk_without_a_gpu(net: Net) -> None:
    planned = infer_auto_device_map(net, max_memory={0: 5000, 1: 5000, "cpu": 5000},
                                    no_split_module_classes=["Block"])
    # Accelerate 1.15. GPU 0 and the cpu keep room for the largest block; GPU 1 does not
    assert list(planned.items()) == [
        ("embed", 0), ("blocks.0", 1), ("blocks.1", 1), ("blocks.2", "cpu"),
        ("blocks.3", "disk"), ("head", "disk"),
    ]
    # keys given in any order or form plan the same
    assert infer_auto_device_map(net, max_memory={"cpu": "5000B", "cuda:1": 5000, 0: 5000},
                                 no_split_module_classes=["Block"]) == planned
    # a device left out of max_memory gets nothing: GPU 0 then disk
    assert infer_auto_device_map(net, max_memory={0: 7000}) == {
        "embed": 0, "blocks.0": 0, "blocks.1": "disk", "blocks.2": "disk", "blocks.3": "disk",
        "head": "disk"}


def test_a_split_module_places_its_own_buffers() -> None:
    with accel.init_empty_weights():
        model = Outer()
    planned = infer_auto_device_map(model, max_memory={"cpu": 2500})
    assert planned == {"first.a": "cpu", "first.b": "disk", "first.pos": "disk",
                       "second": "disk"}
    check_device_map(model, planned)
    # Accelerate 1.15 leaves first.pos out, a map that the check refuses
    accelerate_map = {"first.a": "cpu", "first.b": "disk", "second": "disk"}
    with pytest.raises(DeviceMapError, match=r"\['first.pos'\]"):
        check_device_map(model, accelerate_map)


# --- get_balanced_memory and the named strategies ---------------------------------------

TWO_GPUS = {0: 20_000, 1: 20_000, "cpu": 20_000}


def test_balanced_budgets_spread_the_model_while_sequential_fills_gpu_0(net: Net) -> None:
    balanced = get_balanced_memory(net, max_memory=TWO_GPUS, no_split_module_classes=[Block])
    # 12,800 / 2 + 1.25 x the largest block (2,176): Accelerate 1.15 gives the same
    assert balanced == {0: 9120, 1: 20_000, "cpu": 20_000}
    spread = {"embed": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1,
              "head": 1}
    assert infer_auto_device_map(net, max_memory=balanced,
                                 no_split_module_classes=[Block]) == spread
    expected = {k: torch.device("cuda", v) for k, v in spread.items()}
    for choice in ("auto", "balanced"):
        assert resolve_device_map(net, choice, max_memory=TWO_GPUS,
                                  no_split_module_classes=[Block]) == expected
    assert resolve_device_map(net, "sequential", max_memory=TWO_GPUS,
                              no_split_module_classes=[Block]) == {"": torch.device("cuda", 0)}


def test_balanced_without_no_split_uses_the_mean_layer(net: Net) -> None:
    balanced = get_balanced_memory(net, max_memory=TWO_GPUS)
    assert balanced == {0: 8000, 1: 20_000, "cpu": 20_000}  # Accelerate 1.15
    assert infer_auto_device_map(net, max_memory=balanced) == {
        "embed": 0, "blocks.0": 0, "blocks.1.fc1": 0, "blocks.1.fc2": 1, "blocks.2": 1,
        "blocks.3": 1, "head": 1}


def test_balanced_low_0_leaves_gpu_0_empty(net: Net) -> None:
    assert get_balanced_memory(net, max_memory=TWO_GPUS, low_zero=True,
                               no_split_module_classes=[Block]) == {0: 0, 1: 20_000,
                                                                    "cpu": 20_000}
    assert resolve_device_map(net, "balanced_low_0", max_memory=TWO_GPUS,
                              no_split_module_classes=[Block]) == {"": torch.device("cuda", 1)}
    three = {0: 20_000, 1: 20_000, 2: 20_000, "cpu": 20_000}
    assert get_balanced_memory(net, max_memory=three, low_zero=True,
                               no_split_module_classes=[Block]) == {0: 0, 1: 9120, 2: 20_000,
                                                                    "cpu": 20_000}
    assert resolve_device_map(net, "balanced_low_0", max_memory=three,
                              no_split_module_classes=[Block]) == {
        "embed": torch.device("cuda", 1), "blocks.0": torch.device("cuda", 1),
        "blocks.1": torch.device("cuda", 1), "blocks.2": torch.device("cuda", 1),
        "blocks.3": torch.device("cuda", 2), "head": torch.device("cuda", 2)}


def test_balanced_with_fewer_than_two_gpus_keeps_the_budgets(net: Net) -> None:
    assert get_balanced_memory(net, max_memory={"cpu": 5000}) == {"cpu": 5000}
    assert get_balanced_memory(net, max_memory={0: 5000, "cpu": 5000}) == {0: 5000, "cpu": 5000}
    assert get_balanced_memory(net, max_memory={0: 5000, 1: 0, "cpu": 1}) == {
        0: 5000, 1: 0, "cpu": 1}
    assert resolve_device_map(net, "auto", max_memory={"cpu": 5000}) == {
        "embed": CPU, "blocks": "disk", "head": "disk"}


# --- check_device_map / resolve_device_map ----------------------------------------------


def test_explicit_maps_are_normalized(net: Net) -> None:
    checked = check_device_map(net, {"": "cpu", "embed": 0, "blocks.1": "cuda:1",
                                     "blocks.2.fc1.weight": "disk", "head": CPU})
    assert checked == {"": CPU, "embed": torch.device("cuda", 0),
                       "blocks.1": torch.device("cuda", 1), "blocks.2.fc1.weight": "disk",
                       "head": CPU}
    assert resolve_device_map(net, {"embed": "cpu", "blocks": "disk", "head": "cpu"}) == {
        "embed": CPU, "blocks": "disk", "head": CPU}
    assert check_device_map(net, {"": "cpu"}) == {"": CPU}


def test_an_unknown_name_is_refused_with_the_top_level_modules(net: Net) -> None:
    with pytest.raises(DeviceMapError, match=r"\['blocks.9'\], which the model") as info:
        check_device_map(net, {"": "cpu", "blocks.9": "cpu"})
    assert "['embed', 'blocks', 'head']" in str(info.value)
    with pytest.raises(DeviceMapError, match=r"\[0\], which the model"):
        check_device_map(net, {0: "cpu"})  # type: ignore[dict-item]


def test_an_uncovered_tensor_is_refused_naming_it(net: Net) -> None:
    with pytest.raises(DeviceMapError, match=r"leaves 1 tensor\(s\).*\['head.weight'\]"):
        check_device_map(net, {"embed": "cpu", "blocks": "disk"})
    with pytest.raises(DeviceMapError, match=r"'blocks.0.fc1.bias'"):
        check_device_map(net, {"embed": "cpu", "blocks.0.fc1.weight": "cpu",
                               "blocks.0.fc2": "cpu", "blocks.1": 0, "blocks.2": 0,
                               "blocks.3": 0, "head": "disk"})
    with accel.init_empty_weights():
        tied = Net(tied=True)
    # a tied name needs an entry too, as in the checkpoint
    with pytest.raises(DeviceMapError, match=r"\['head.weight'\]"):
        check_device_map(tied, {"embed": "cpu", "blocks": "cpu"})


def test_a_bad_device_in_a_map_is_refused(net: Net) -> None:
    with pytest.raises(DeviceMapError, match=r"'nowhere' is not a device"):
        check_device_map(net, {"": "nowhere"})
    with pytest.raises(DeviceMapError, match=r"-1 is not a device"):
        check_device_map(net, {"": -1})
    with pytest.raises(DeviceMapError, match=r"puts \['embed'\] on 'meta'"):
        check_device_map(net, {"": "cpu", "embed": "meta"})


def test_a_map_that_is_not_a_mapping_is_refused(net: Net) -> None:
    with pytest.raises(DeviceMapError, match=r"device_map=\[\('', 'cpu'\)\] is not a"):
        check_device_map(net, [("", "cpu")])  # type: ignore[arg-type]
    with pytest.raises(DeviceMapError, match=r"device_map=5 is not a mapping"):
        resolve_device_map(net, 5)  # type: ignore[arg-type]


@pytest.mark.parametrize("choice", ["automatic", "Auto", "", "balanced_low_1"])
def test_resolve_refuses_an_unknown_strategy_listing_the_choices(net: Net, choice: str) -> None:
    with pytest.raises(DeviceMapError) as info:
        resolve_device_map(net, choice)
    message = str(info.value)
    assert f"device_map={choice!r} is not a choice" in message
    assert "'auto', 'balanced', 'balanced_low_0', 'sequential'" in message


# --- defaults read from the machine (faked GPUs), sizes, ties, meta models --------------


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, free: list[int], ram: int = 10_000) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(free))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 10 * free[i]))
    monkeypatch.setattr(dm, "_available_ram", lambda: ram)


def test_default_budgets_are_each_gpus_free_memory_then_the_ram_margin(
    monkeypatch: pytest.MonkeyPatch, net: Net
) -> None:
    _fake_gpus(monkeypatch, [5000, 5000], ram=10_000)
    assert parse_max_memory(None) == {0: 5000, 1: 5000, "cpu": 9000}
    # a given mapping gets no defaults for the devices it leaves out (as Accelerate)
    assert parse_max_memory({"cpu": 50}) == {"cpu": 50}
    # infer with no max_memory plans on those defaults: the same as passing them
    assert infer_auto_device_map(net, no_split_module_classes=["Block"]) == infer_auto_device_map(
        net, max_memory={0: 5000, 1: 5000, "cpu": 9000}, no_split_module_classes=["Block"]
    )
    # one GPU and no max_memory: balanced keeps 10% of it free, as Accelerate does
    _fake_gpus(monkeypatch, [1000], ram=10_000)
    assert get_balanced_memory(net) == {0: 900, "cpu": 9000}


def test_available_ram_falls_back_to_sysconf_without_proc_meminfo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    def no_file(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no /proc here")

    monkeypatch.setattr(dm, "open", no_file, raising=False)
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert abs(dm._available_ram() - pages) < 512 * 2**20  # it moves while we read


def test_a_tied_partner_is_split_when_only_the_pair_does_not_fit() -> None:
    def lin() -> nn.Linear:
        return nn.Linear(10, 10, bias=False)  # 400 bytes

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = lin()
            self.second = nn.Sequential(lin(), lin(), lin())
            self.second[2].weight = self.first.weight

    # cpu 1000 - 400 (largest layer) = 600: first + all of second (800 more) does not fit,
    # first + the part of second holding the tie does: second is split, second.2 goes with
    # first; second.0 then does not fit (Accelerate 1.15 gives the same)
    assert infer_auto_device_map(Pair(), max_memory={"cpu": 1000}) == {
        "first": "cpu", "second.0": "disk", "second.1": "disk", "second.2": "cpu"}
    # the room kept is for the largest layer still to place: with 1200 the last one fits
    assert infer_auto_device_map(Pair(), max_memory={"cpu": 1200}) == {"": "cpu"}


def test_module_sizes_count_buffers_and_keep_integer_tensors_as_they_are() -> None:
    model = nn.Module()
    model.lin = nn.Linear(10, 10, bias=False)
    model.register_buffer("ids", torch.arange(100))  # int64: 800 bytes in any dtype
    model.norm = nn.BatchNorm1d(10)  # 2 x 10 params, 2 x 10 float buffers, one int64 count
    sizes = model_walk.module_sizes(model, torch.float16)
    assert sizes["lin"] == 200 and sizes["ids"] == 800
    assert sizes["norm"] == 4 * 20 + 8 and sizes[""] == 200 + 800 + 88
    assert model_walk.module_sizes(model)["norm"] == 4 * 40 + 8


def test_a_meta_model_is_planned_like_the_real_one(net: Net) -> None:
    torch.manual_seed(0)
    real = Net(tied=True)
    with accel.init_empty_weights():
        empty = Net(tied=True)
    for budget in ({"cpu": 5000}, {0: 4000, 1: 4000, "cpu": 4000}):
        assert infer_auto_device_map(empty, max_memory=budget) == infer_auto_device_map(
            real, max_memory=budget
        )


def test_balanced_low_0_on_gpus_numbered_from_1(net: Net) -> None:
    # the first GPU listed plays GPU 0's part (Accelerate would look up GPU 0 and fail)
    assert get_balanced_memory(net, max_memory={1: 20_000, 2: 20_000}, low_zero=True,
                               no_split_module_classes=[Block]) == {1: 0, 2: 20_000}


def test_an_uncovered_non_persistent_buffer_is_named(net: Net) -> None:
    net.register_buffer("steps", torch.zeros(1), persistent=False)
    with pytest.raises(DeviceMapError, match=r"\['steps'\]"):
        check_device_map(net, {"embed": "cpu", "blocks": "cpu", "head": "cpu"})


def test_a_weight_tied_in_four_places_splits_partners_in_name_order() -> None:
    def lin() -> nn.Linear:
        return nn.Linear(10, 10, bias=False)  # 400 bytes

    class Half(nn.Module):
        def __init__(self, embed: nn.Embedding) -> None:
            super().__init__()
            self.embed_tokens = embed
            self.layers = nn.Sequential(lin(), lin())

    class Shared(nn.Module):
        """T5's layout: one embedding under shared, encoder, decoder and lm_head."""

        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Embedding(10, 10)
            self.encoder = Half(self.shared)
            self.decoder = Half(self.shared)
            self.lm_head = lin()
            self.lm_head.weight = self.shared.weight

    # cpu 1600 - 400 = 1200: shared pulls encoder, decoder and lm_head (2000) along; the first
    # splittable partner by name, decoder, is split (Accelerate sorts each tie group by name);
    # then shared + encoder + decoder.embed_tokens + lm_head (1200) fit and decoder.layers
    # goes to disk. Accelerate 1.15 gives the same map.
    assert infer_auto_device_map(Shared(), max_memory={"cpu": 1600}) == {
        "shared": "cpu", "encoder": "cpu", "decoder.embed_tokens": "cpu",
        "decoder.layers": "disk", "lm_head": "cpu"}
    assert model_walk.tied_groups(Shared()) == [
        ["decoder.embed_tokens.weight", "encoder.embed_tokens.weight", "lm_head.weight",
         "shared.weight"]]
