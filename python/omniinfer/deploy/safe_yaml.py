"""Reading a YAML file that may be hostile: bounded in size, text only, a plain tree.

``read(path)`` returns the decoded document or raises ``Refused`` with one short printable
line (no file name: the caller adds it). It never reads more than ``MAX_FILE_BYTES + 1`` bytes
(``/dev/zero`` and pipes included), and refuses:

- a file over ``MAX_FILE_BYTES`` (1 MiB), bytes that are not UTF-8, a NUL byte (binary);
- anchors and aliases (``&a``/``*a``, hence merge keys ``<<: *a``): a "billion laughs" file
  cannot expand, and a deployment file never needs them;
- merge keys (``<<``), a key twice in one mapping, nesting deeper than ``MAX_DEPTH``, an
  integer of more than ``MAX_INT_CHARS`` characters, and anything ``yaml.SafeLoader`` refuses
  (Python tags, several documents, syntax errors), each with its line.

``show``, ``clip`` and ``printable`` make user data fit in such a line: printable, and (the
first two) at most 80 characters.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node

MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 16
MAX_INT_CHARS = 64
SHOWN_CHARS = 80
MERGE_TAG = "tag:yaml.org,2002:merge"


class Refused(ValueError):
    """The file cannot be read as a deployment file; ``str()`` is one short printable line."""


def printable(text: str) -> str:
    """``text`` with each non-printable character (line breaks, escapes, bidi controls)
    written as its Python escape, so that it stays on one line and shows what it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """``printable(text)`` cut to at most ``limit`` characters, a cut marked by ``...``."""
    text = printable(text[:limit * 2])
    return text if len(text) <= limit else text[:limit - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxtuple = 2, 4, 4, 4
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = SHOWN_CHARS + 10


def show(value: Any) -> str:
    """A short ``repr`` of a value from the file for an error message: at most 80 printable
    characters, cheap whatever the value's size."""
    return clip(_REPR.repr(value))


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` without anchors, aliases, merge keys or duplicate keys, nesting bounded."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ConstructorError(None, None, "anchors and aliases (& and *) are not allowed",
                                   event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConstructorError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                       event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                raise ConstructorError(None, None, "merge keys (<<) are not allowed",
                                       key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: SafeLoader's own error follows
                continue
            if duplicate:
                raise ConstructorError(None, None, f"duplicate key {show(key)}",
                                       key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_bounded_int(self, node: Node) -> int:
        if len(str(node.value)) > MAX_INT_CHARS:
            raise ConstructorError(None, None, f"an integer of more than {MAX_INT_CHARS} "
                                   "characters", node.start_mark)
        value: int = self.construct_yaml_int(node)
        return value


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_bounded_int)


def read_text(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The file's text: at most ``max_bytes`` bytes of UTF-8 without a NUL byte."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise Refused(f"cannot read: {clip(str(getattr(exc, 'strerror', None) or exc))}"
                      ) from None
    if len(raw) > max_bytes:
        raise Refused(f"larger than {_size(max_bytes)} (the most a deployment file may hold)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(f"not UTF-8 text (byte {exc.start}): a deployment file is YAML "
                      "text") from None
    if "\0" in text:
        raise Refused(f"binary content (a NUL byte at byte {raw.index(0)}): a deployment "
                      "file is YAML text")
    return text


def load_text(text: str) -> Any:
    """The one YAML document of ``text``, through the strict loader."""
    try:
        loader = _StrictLoader(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = exc.problem or exc.context or "malformed"
        if exc.context and problem.startswith("but "):  # "expected X, but found Y"
            problem = f"{exc.context}, {problem}"
        raise Refused(f"not valid YAML{where}: {clip(problem, 2 * SHOWN_CHARS)}") from None
    except yaml.YAMLError as exc:  # the reader's: a character YAML does not allow
        raise Refused(f"not valid YAML: {clip(str(exc).splitlines()[0])}") from None
    except (RecursionError, ValueError) as exc:  # belt and braces behind the bounds above
        raise Refused(f"not valid YAML: {clip(type(exc).__name__)}") from None


def read(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """``load_text(read_text(path))``: the decoded document of a bounded, strict YAML file."""
    return load_text(read_text(path, max_bytes))


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n} bytes"
