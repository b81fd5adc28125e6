"""Reading an Accelerate config file as untrusted input, for ``accel config import``.

At most :data:`MAX_BYTES` (``accelerate config`` writes a few hundred), nesting at most
:data:`MAX_DEPTH` containers deep, and without YAML anchors or aliases (``&name`` / ``*name``:
a few hundred bytes of nested aliases expand to gigabytes, the "billion laughs"; Accelerate
never writes them). YAML is read with PyYAML's safe loader (no object construction), from the
optional extra ``accel[yaml]``; JSON needs nothing.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from accel.errors import ConfigError

__all__ = ["MAX_BYTES", "MAX_DEPTH", "clip", "read_config_file"]

MAX_BYTES = 1 << 20
MAX_DEPTH = 32  # containers within containers (the file's top-level mapping is one)
# what the JSON scan looks at: strings (keys), brackets, commas and colons
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:]')


def clip(text: str, limit: int = 200) -> str:
    """``text``, or its first ``limit`` characters and how long it was.

    Example:
        >>> clip("x" * 300, 5)
        'xxxxx... (300 characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def read_config_file(path: Path) -> dict[str, Any]:
    """The top-level mapping of an Accelerate config file (YAML, or JSON by its suffix), read
    as untrusted input.

    Raises:
        ConfigError: the file is missing, not a regular file, over :data:`MAX_BYTES`, nested
            over :data:`MAX_DEPTH` containers, uses YAML anchors or aliases, is not valid
            YAML/JSON, or does not hold a mapping; the message names the file and the place.

    Example:
        >>> read_config_file(Path("default_config.yaml"))["distributed_type"]
        'MULTI_GPU'
    """
    from accel._files.safe_io import read_bounded
    from accel.errors import CheckpointError

    where = os.fspath(path)
    try:
        size = os.stat(path).st_size
        if size > MAX_BYTES:
            raise ConfigError(
                f"The Accelerate config {where!r} is {size} bytes, more than the {MAX_BYTES} "
                "accel reads for one (`accelerate config` writes a few hundred). Give the "
                "Accelerate config file itself: `accel config import "
                "path/to/default_config.yaml`. Nothing was written."
            )
        raw = read_bounded(path, MAX_BYTES, follow_links=True)
    except FileNotFoundError:
        raise ConfigError(
            f"There is no Accelerate config at {where!r}. Give its path: `accel config import "
            "path/to/default_config.yaml`."
        ) from None
    except CheckpointError:  # a FIFO or a device, or it grew past the limit while read
        raise ConfigError(
            f"The Accelerate config {where!r} is not a regular file of at most {MAX_BYTES} "
            "bytes. Give the file `accelerate config` wrote: `accel config import "
            "path/to/default_config.yaml`."
        ) from None
    except OSError as exc:
        raise ConfigError(f"Cannot read the Accelerate config {where!r} ({exc}).") from None
    if path.suffix == ".json":
        _check_json_depth(raw, where)
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError as exc:
            raise ConfigError(f"{where!r} is not valid JSON ({exc}).") from None
    else:
        data = _load_yaml(raw, where)
    if data is None:
        data = {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(
            f"{where!r} holds a {type(data).__name__}, not a mapping of keys to values; an "
            "Accelerate config file is `key: value` lines (as `accelerate config` writes)."
        )
    return data


def _too_deep(where: str, place: str) -> ConfigError:
    return ConfigError(
        f"{where!r}: {clip(place or 'the top level', 120)} nests more than {MAX_DEPTH} "
        "levels deep (containers within containers); an Accelerate config nests a few at "
        "most. Flatten that value (`accelerate config` writes a valid file). Nothing was "
        "written."
    )


def _check_json_depth(raw: bytes, where: str) -> None:
    """Refuse JSON nesting more than :data:`MAX_DEPTH` containers deep, naming where, before
    parsing it (the parser recurses once per level). A scan without recursion."""
    stack: list[list[Any]] = []  # per open container: [is an object, the key or index]
    last = b""
    for match in _JSON_TOKEN.finditer(raw):
        token = match.group()
        if token in (b"{", b"["):
            if len(stack) >= MAX_DEPTH:
                place = "".join(f"[{label}]" if not is_object else f".{label}"
                                for is_object, label in stack)
                raise _too_deep(where, place.lstrip("."))
            stack.append([token == b"{", 0 if token == b"[" else "?"])
        elif token in (b"}", b"]"):
            if stack:
                stack.pop()
        elif token == b":":
            if stack and stack[-1][0]:
                try:
                    key = json.loads(last)
                except ValueError:
                    key = last.decode("utf-8", "replace")
                stack[-1][1] = clip(str(key), 60)
        elif token == b",":
            if stack and not stack[-1][0]:
                stack[-1][1] += 1
        else:
            last = token


def _yaml_loader(yaml: Any, where: str) -> Any:
    """PyYAML's SafeLoader refusing anchors, aliases and deep nesting as it composes (before
    anything is expanded), naming where in the file."""

    class Loader(yaml.SafeLoader):  # type: ignore[misc, unused-ignore]
        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            self.path: list[str] = []

        def compose_node(self, parent: Any, index: Any) -> Any:
            if parent is None:
                label = ""
            elif isinstance(index, int):
                label = f"[{index}]"
            elif isinstance(index, yaml.ScalarNode):
                label = f".{clip(str(index.value), 60)}"
            else:  # a key (or a key that is itself a collection)
                label = ".?"
            self.path.append(label)
            try:
                event = self.peek_event()
                place = "".join(self.path).lstrip(".")
                if isinstance(event, yaml.AliasEvent) or event.anchor is not None:
                    alias = isinstance(event, yaml.AliasEvent)
                    name = ("*" if alias else "&") + clip(str(event.anchor), 40)
                    raise ConfigError(
                        f"{where!r}: {clip(place or 'the top level', 120)} uses a YAML "
                        f"{'alias' if alias else 'anchor'} ({name}); accel reads Accelerate "
                        "config files without anchors and aliases (a few hundred bytes of "
                        "nested aliases expand to gigabytes), and `accelerate config` never "
                        "writes them. Write the value out in full, without `&name` and "
                        "`*name`. Nothing was written."
                    )
                collection = isinstance(event, yaml.CollectionStartEvent)
                if collection and len(self.path) > MAX_DEPTH:
                    raise _too_deep(where, place)
                return super().compose_node(parent, index)
            finally:
                self.path.pop()

    return Loader


def _load_yaml(raw: bytes, where: str) -> Any:
    try:
        import yaml  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        raise ConfigError(
            f"Reading the YAML file {where!r} needs PyYAML, from the optional extra `yaml`: "
            "`pip install 'accel[yaml]'` (or `pip install pyyaml`)."
        ) from None
    try:
        # a SafeLoader (no object is constructed) that refuses anchors, aliases, deep nesting
        return yaml.load(raw.decode("utf-8"), Loader=_yaml_loader(yaml, where))
    except (yaml.YAMLError, ValueError, OverflowError) as exc:  # ValueError: not UTF-8, an
        # integer of over 4300 digits, a date that does not exist (2001-13-45)...
        raise ConfigError(f"{where!r} is not valid YAML ({clip(str(exc), 600)}).") from None
