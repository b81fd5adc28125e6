"""``accel.init_partitioned()``: build a model already partitioned under ZeRO-3.

Inside ``accel.distributed(strategy="deepspeed")`` with ZeRO stage 3, the context enters
DeepSpeed's ``deepspeed.zero.Init`` with the block's config (the one ``accel.prepare`` will
hand to ``deepspeed.initialize``, its dtype from ``mixed_precision``), so each parameter is
partitioned across the ranks as soon as its module is built: no process ever holds the
whole model. While it is open, an imported transformers sees ZeRO-3 too (its
``is_deepspeed_zero3_enabled()``), so ``from_pretrained`` / ``from_config`` build, initialise
and load their weights the ZeRO-3 way.

Anywhere else (another strategy, ZeRO 0-2, no block) the context does nothing: the model is
built whole as usual, so one script runs under every strategy.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from accel.core.settings import DEEPSPEED_KEYS
from accel.core.state import state
from accel.parallel.deepspeed.config import Facts, build_config, partition_config, zero_stage
from accel.parallel.deepspeed.engine import start_deepspeed

__all__ = ["init_partitioned", "partition_config_of_block"]


def partition_config_of_block() -> dict[str, Any] | None:
    """The config ``deepspeed.zero.Init`` gets in this block, or ``None`` when the block does
    not run ZeRO-3 under ``strategy="deepspeed"``.

    Raises:
        ConfigError: an invalid DeepSpeed config or shortcut, or ``mixed_precision``
            contradicting the config's bf16/fp16 (the errors ``accel.prepare`` would give).

    Example:
        >>> with accel.distributed(strategy="deepspeed", zero_stage=3, mixed_precision="bf16"):
        ...     partition_config_of_block()["bf16"]
        {'enabled': True}
    """
    st = state()
    if st.strategy != "deepspeed":
        return None
    options = {key: st.options.get(key) for key in DEEPSPEED_KEYS}
    config = build_config(
        options["deepspeed_config"], zero_stage=options["zero_stage"],
        offload_optimizer=options["offload_optimizer"], offload_params=options["offload_params"],
    )
    if zero_stage(config) != 3:
        return None
    facts = Facts(
        mixed_precision=st.mixed_precision,
        gradient_accumulation_steps=st.gradient_accumulation_steps,
        world_size=st.world_size,
    )
    return partition_config(config, facts)


class _Zero3View:
    """What transformers asks of its DeepSpeed config object (``HfDeepSpeedConfig``, which
    needs Accelerate): the config and whether it is ZeRO-3."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)

    def is_zero3(self) -> bool:
        return True


@contextmanager
def _transformers_sees_zero3(config: Mapping[str, Any]) -> Iterator[None]:
    """transformers' ``is_deepspeed_zero3_enabled()`` is true while the context is open (it
    reads a module-level weak reference, set by ``set_hf_deepspeed_config``); the previous
    reference comes back at the end. Nothing when transformers is not imported: a script
    that builds a transformers model has imported it (importing it here would cost seconds
    to scripts that do not use it)."""
    if "transformers" not in sys.modules:
        yield
        return
    integration = importlib.import_module("transformers.integrations.deepspeed")
    reference = getattr(integration, "_hf_deepspeed_config_weak_ref", None)
    previous = reference() if callable(reference) else None  # an HfDeepSpeedConfig, if any
    view = _Zero3View(config)  # referenced here until the end: the weak reference holds
    integration.set_hf_deepspeed_config(view)
    try:
        yield
    finally:
        if previous is not None:
            integration.set_hf_deepspeed_config(previous)
        else:
            integration.unset_hf_deepspeed_config()


@contextmanager
def init_partitioned() -> Iterator[None]:
    """Build a model already partitioned across the ranks (DeepSpeed ZeRO-3's ``zero.Init``).

    Inside ``accel.distributed(strategy="deepspeed")`` with ZeRO stage 3, every parameter
    created in the context is partitioned as soon as its module's ``__init__`` returns: each
    rank keeps ``1/world_size`` of it, in the dtype ``mixed_precision`` gives (bf16, fp16 or
    fp32), offloaded where the config's ``offload_param`` says, so a model larger than one
    process's memory can be built. Rank 0's initial values are the ones kept (DeepSpeed
    broadcasts each parameter before partitioning it), as ``deepspeed.initialize`` does
    with a model built whole. Then ``accel.prepare(model, optimizer, loader)`` works as
    usual, and ``get_state_dict``, ``save_model``, ``save_state`` give full weights.

    An imported transformers sees ZeRO-3 while the context is open
    (``is_deepspeed_zero3_enabled()``), so build transformers models with ``from_config`` /
    ``from_pretrained`` in it: they initialise (or load) the partitioned weights the ZeRO-3
    way. The class itself (``GPT2LMHeadModel(config)``) would leave the embeddings at
    torch's init: transformers' own init does not reach the partitions then.

    Under any other strategy, ZeRO stage 0-2, or outside ``accel.distributed``, the context
    does nothing and the model is built whole, so a script keeps one loop for every
    strategy. Every rank must enter it and build the same model (each parameter is a
    collective).

    Raises:
        ConfigError: DeepSpeed is not installed, the DeepSpeed config or a shortcut is
            invalid, or ``mixed_precision`` contradicts the config's bf16/fp16.

    Example:
        >>> with accel.distributed(strategy="deepspeed", zero_stage=3, mixed_precision="bf16"):
        ...     with accel.init_partitioned():
        ...         model = transformers.AutoModelForCausalLM.from_config(config)
        ...     model, optimizer, loader = accel.prepare(model, optimizer, loader)
    """
    config = partition_config_of_block()
    if config is None:
        yield
        return
    ds = start_deepspeed()
    with ds.zero.Init(config_dict_or_path=config), _transformers_sees_zero3(config):
        yield
