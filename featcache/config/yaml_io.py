"""Reading config YAML: plain data only, and a key given twice in one mapping is an error
(PyYAML's safe loader silently keeps the last one). Merge keys (``<<: *base``) still
override what they merge, as YAML defines."""

from __future__ import annotations

from typing import Any

import yaml


class RepeatedKeyError(yaml.YAMLError):
    """A mapping names the same key twice: ``key``, at 1-based lines ``first`` and ``second``."""

    def __init__(self, key: Any, first: int, second: int):
        where = f"line {first}" if first == second else f"lines {first} and {second}"
        super().__init__(f"the key {key!r} is given twice ({where})")
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}  # key -> the line it was first given on
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise RepeatedKeyError(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the safe loader refuses it below
                continue
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str) -> Any:
    """``text`` as plain YAML data.

    Raises:
        RepeatedKeyError: when a mapping gives one key twice.
        yaml.YAMLError: for any other text that is not YAML.
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a safe loader
