"""Reading a YAML file while keeping where each key came from.

PyYAML's node tree knows every key's line; plain ``yaml.safe_load`` forgets it.
:func:`read` composes the node tree, builds plain Python values from it and
keeps a table from each key path (``("nets", "gru", "step", 2)``) to its line,
so every error can say ``file:line: key: what is wrong``.
"""

from __future__ import annotations

import difflib
import keyword
import re
from pathlib import Path

import yaml

from .. import sizes
from ..errors import SizeError, YAMLError


def format_key(path) -> str:
    """``("nets", "gru", "step", 2)`` -> ``"nets.gru.step[2]"``.

    How error messages name a key of a YAML file.

    Parameters
    ----------
    path : iterable of str or int
        The keys from the document's root: mapping keys (str) and list
        indices (int).

    Returns
    -------
    str
        Keys joined with ``.``, indices as ``[i]``; ``"(document)"`` for the
        empty path.

    Examples
    --------
    >>> from stepnet.yaml import format_key
    >>> format_key(("nets", "gru", "step", 2))
    'nets.gru.step[2]'
    """
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "(document)"


def did_you_mean(name, choices) -> str:
    """``"; did you mean 'x'?"`` when a close match exists, else ``""``."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


class Document:
    """A parsed YAML file: ``data`` (plain dicts, lists, scalars) and the line
    of every key path, for error messages."""

    def __init__(self, path, data, lines):
        self.path = Path(path)
        self.data = data
        self.lines = lines

    def line(self, path) -> int:
        """The 1-based line of ``path`` (or of its nearest enclosing key)."""
        path = tuple(path)
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, 1)

    def error(self, path, message, line=None) -> YAMLError:
        """A YAMLError naming this file, the line of ``path`` and the key."""
        line = self.line(path) if line is None else line
        err = YAMLError(f"{self.path}:{line}: {format_key(path)}: {message}")
        err.file, err.line, err.key = str(self.path), line, format_key(path)
        return err

    # -- typed access ------------------------------------------------------

    def mapping(self, value, path, allowed=None, required=()):
        """Check that ``value`` is a mapping with only ``allowed`` keys."""
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise self.error(path, f"expected a mapping (key: value lines), got {_kind(value)}")
        for key in value:
            if not isinstance(key, str):
                read = (" (YAML reads an unquoted yes, no, on, off, true or false as a "
                        "boolean, and digits as a number: quote the name)"
                        if isinstance(key, (bool, int, float)) else "")
                raise self.error(path, f"key {key!r} must be a string{read}")
            if allowed is not None and key not in allowed:
                raise self.error(
                    path + (key,),
                    f"unknown key {key!r}; expected one of {', '.join(allowed)}"
                    + did_you_mean(key, allowed),
                )
        for key in required:
            if key not in value:
                raise self.error(path, f"missing key {key!r}")
        return value

    def sequence(self, value, path):
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(path, f"expected a list, got {_kind(value)}")
        return value

    def shape(self, value, path):
        """A feature shape: a list of positive ints (``[]`` for scalars per row)."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value
        ):
            raise self.error(path, f"a shape is a list of positive integers, e.g. [64]; got {value!r}")
        if path[:1] != ("parameters",):  # (a parameter is checked with its dtype where it is made)
            try:
                sizes.check("one row", value, None)
            except SizeError as exc:
                raise SizeError(*self.error(path, str(exc)).args) from None
        return tuple(value)

    def name(self, value, path):
        if not isinstance(value, str) or not value.isidentifier():
            raise self.error(path, f"{value!r} is not a valid name (letters, digits and _)")
        if keyword.iskeyword(value):
            raise self.error(path, f"{value!r} is a Python keyword, which an expression cannot "
                                   "name; choose another name")
        return value


def _kind(value) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"


def read(path) -> Document:
    """Parse ``path``; malformed YAML raises a YAMLError with file, line, key."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise Document(path, None, {}).error((), "cannot read the file: "
                                             f"{exc.strerror or exc}", line=1) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise Document(path, None, {}).error((), f"byte {data[exc.start]:#04x} at offset "
                                             f"{exc.start} is not UTF-8 text", line=line) from None
    return parse(text, path)


def parse(text, path="<string>") -> Document:
    lines = {}
    doc = Document(path, None, lines)
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as exc:  # (a character YAML refuses; the reader checks all first)
        line = text[:exc.position].count("\n") + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise doc.error(_key_before(text, line), f"bad YAML: character U+{code:04X}: {exc.reason}",
                        line=line) from None
    try:
        node = loader.get_single_node()
        if node is None:
            raise doc.error((), "the file is empty; a model needs inputs, nets and outputs")
        doc.data = _build(loader, node, (), lines, doc)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        message = f"bad YAML: {problem}" + (f" ({context})" if context else "")
        raise doc.error(_key_before(text, line), message, line=line) from None
    finally:
        loader.dispose()
    return doc


def _build(loader, node, path, lines, doc):
    if isinstance(node, yaml.MappingNode):
        out = {}
        loader.flatten_mapping(node)  # resolves `<<:` merge keys
        for key_node, value_node in node.value:
            key = _build(loader, key_node, path, lines, doc)
            if isinstance(key, (dict, list)):
                raise doc.error(path, "a key must be a plain name", line=key_node.start_mark.line + 1)
            if key in out:
                raise doc.error(
                    path + (key,),
                    f"key {key!r} appears twice (first on line {lines[path + (key,)]})",
                    line=key_node.start_mark.line + 1,
                )
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _build(loader, value_node, path + (key,), lines, doc)
        return out
    if isinstance(node, yaml.SequenceNode):
        out = []
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            out.append(_build(loader, item, path + (i,), lines, doc))
        return out
    return loader.construct_object(node, deep=True)


def _key_before(text, line):
    """The dotted key path of the last ``key:`` at or above ``line`` (for
    syntax errors, where the parser gives only a position)."""
    stack = []  # (indent, key)
    for raw in text.splitlines()[:line]:
        match = re.match(r"^(\s*)(?:-\s+)?([A-Za-z_][\w.]*)\s*:", raw)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group(2)))
    return tuple(key for _, key in stack)
