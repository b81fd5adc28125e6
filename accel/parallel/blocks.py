"""The blocks a model's own code declares: HuggingFace transformers' ``_no_split_modules``.

A transformers model class lists the classes of its repeated blocks (``GPT2Block``,
``LlamaDecoderLayer``, ``T5Block``, ...) in ``_no_split_modules``: the units that must stay
whole on one device and that FSDP wraps one by one. accel reads them, as Accelerate users get
from transformers, for FSDP's default ``shard_modules`` and for the big-model functions'
default ``no_split_module_classes``. Any module class may declare the attribute; models that
do not (plain torch) keep accel's own defaults.
"""

from __future__ import annotations

from torch import nn

__all__ = ["declared_blocks"]


def declared_blocks(model: nn.Module) -> list[str]:
    """Class names declared in ``_no_split_modules`` anywhere in ``model`` that occur in it.

    Wrappers (a peft ``PeftModel``, an ``accel`` prepared model) are looked through: every
    submodule's class is read. Names are in first-declared order, without repeats.

    Example:
        >>> declared_blocks(transformers.GPT2LMHeadModel(config))
        ['GPT2Block']
        >>> declared_blocks(nn.Sequential(nn.Linear(2, 2)))
        []
    """
    declared: dict[str, None] = {}
    present: set[str] = set()
    for module in model.modules():
        present.add(type(module).__name__)
        names = getattr(type(module), "_no_split_modules", None)
        if isinstance(names, list | tuple | set | frozenset):
            for name in names:
                if isinstance(name, str):
                    declared.setdefault(name, None)
    return [name for name in declared if name in present]
