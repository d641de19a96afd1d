"""Every public name of stepnet has a docstring, and every parameter of a
public function, method or constructor is named in its docstring's NumPy-style
``Parameters`` section.

Public: what ``stepnet`` and its public packages export (their ``__all__``, or
else the functions and classes their module defines under a name without a
leading underscore), and the public methods (no leading underscore, plus
``__call__``) and properties of the public classes, those they inherit from
stepnet's own classes included. A constructor's parameters are documented in
the class docstring (or in ``__init__``'s). An exported module needs a
docstring of its own; its members are walked only where it is one of
``PACKAGES``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

PACKAGES = ["stepnet", "stepnet.nn", "stepnet.ops", "stepnet.optim", "stepnet.onnx", "stepnet.torch",
            "stepnet.jax", "stepnet.distributed", "stepnet.yaml"]
OPTIONAL = {"stepnet.torch": "torch", "stepnet.jax": "jax"}  # modules that need another package

_SECTION = re.compile(r"^(\s*)Parameters\s*\n\1-{3,}\s*\n", re.M)
_HEADER = re.compile(r"^[ \t]*\S[^\n]*\n[ \t]*-{3,}[ \t]*$", re.M)  # a section's title and underline


def documented_parameters(doc: str | None) -> set[str]:
    """The names that the ``Parameters`` section of ``doc`` describes (``a, b : int``
    names two; leading ``*`` are dropped)."""
    if not doc:
        return set()
    doc = inspect.cleandoc(doc)
    m = _SECTION.search(doc)
    if not m:
        return set()
    indent = m.group(1)
    body = doc[m.end():]
    end = _HEADER.search(body)
    body = body[:end.start()] if end else body
    names = set()
    for line in body.splitlines():
        if not line.startswith(indent) or line[len(indent):len(indent) + 1].isspace() or not line.strip():
            continue
        head = line.strip().split(" : ")[0].split(":")[0] if " : " in line or line.rstrip().endswith(":") \
            else line.strip()
        for name in head.split(","):
            name = name.strip().lstrip("*")
            if re.fullmatch(r"[A-Za-z_]\w*", name):
                names.add(name)
    return names


def signature_parameters(function, skip_first: bool) -> list[str]:
    """The parameter names of ``function`` (without ``self``/``cls``), ``*`` dropped."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return []
    if skip_first and params and params[0].name in ("self", "cls"):
        params = params[1:]
    return [p.name for p in params]


def public_names(module) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [name for name, obj in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
            and getattr(obj, "__module__", None) == module.__name__]


def _class_members(cls):
    """``(name, kind, function)`` for the public methods and properties of ``cls``
    that stepnet defines (in ``cls`` or a stepnet base class)."""
    seen = set()
    for base in cls.__mro__:
        if not (base.__module__ or "").startswith("stepnet"):
            continue
        for name, attr in vars(base).items():
            if name in seen or (name.startswith("_") and name != "__call__"):
                continue
            seen.add(name)
            if isinstance(attr, property):
                yield name, "property", attr.fget
            elif isinstance(attr, (staticmethod, classmethod)):
                yield name, type(attr).__name__, attr.__func__
            elif inspect.isfunction(attr):
                yield name, "method", attr


def _constructor(cls):
    """The ``__init__`` that stepnet wrote for ``cls``, or None (an exception's,
    a NamedTuple's)."""
    for base in cls.__mro__:
        init = vars(base).get("__init__")
        if init is not None:
            return init if (base.__module__ or "").startswith("stepnet") else None
    return None


def check_function(qualname: str, function, doc_owner=None, skip_first=False) -> list[str]:
    """What is missing from the docstring of ``function``."""
    doc = inspect.getdoc(doc_owner if doc_owner is not None else function)
    if not doc or not doc.strip():
        return [f"{qualname}: no docstring"]
    params = signature_parameters(function, skip_first)
    missing = [p for p in params if p not in documented_parameters(doc)]
    if missing:
        return [f"{qualname}: the Parameters section does not name {', '.join(missing)}"]
    return []


def check_class(qualname: str, cls, seen: set | None = None) -> list[str]:
    """What is missing from the docstrings of ``cls``, its constructor's
    parameters and its public methods (each method once: one in ``seen``, a
    set of ids, was checked under another class)."""
    seen = set() if seen is None else seen
    problems = []
    if not cls.__doc__ or not cls.__doc__.strip():
        problems.append(f"{qualname}: no docstring")
    init = _constructor(cls)
    if init is not None and cls.__doc__:
        params = signature_parameters(init, skip_first=True)
        named = documented_parameters(cls.__doc__) | documented_parameters(init.__doc__)
        missing = [p for p in params if p not in named]
        if missing:
            problems.append(f"{qualname}(): the Parameters section does not name {', '.join(missing)}")
    for name, kind, function in _class_members(cls):
        if id(function) in seen:
            continue
        seen.add(id(function))
        where = f"{qualname}.{name}"
        if kind == "property":
            if not (function.__doc__ or "").strip():
                problems.append(f"{where}: no docstring")
        else:
            problems += check_function(where, function, skip_first=kind != "staticmethod")
    return problems


def api_problems(packages=PACKAGES) -> list[str]:
    """Every missing docstring and undocumented parameter of the public API."""
    problems, seen = [], set()
    for package in packages:
        module = importlib.import_module(package)
        if not (module.__doc__ or "").strip():
            problems.append(f"{package}: no docstring")
        for name in public_names(module):
            obj = getattr(module, name)
            qualname = f"{package}.{name}"
            if id(obj) in seen and not isinstance(obj, types.ModuleType):
                continue
            seen.add(id(obj))
            if isinstance(obj, types.ModuleType):
                if not (obj.__doc__ or "").strip():
                    problems.append(f"{qualname}: no docstring")
            elif inspect.isclass(obj):
                problems += check_class(qualname, obj, seen)
            elif callable(obj):
                problems += check_function(qualname, obj)
    return problems


def _available(package: str) -> bool:
    need = OPTIONAL.get(package)
    if need is None:
        return True
    try:
        importlib.import_module(need)
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------
# the checker itself


def test_parameters_sections_are_read():
    doc = """Do it.

    Parameters
    ----------
    x, y : int
        The numbers.
    backend : str, optional
    **kwargs
        More.

    Returns
    -------
    z : int
    """
    assert documented_parameters(doc) == {"x", "y", "backend", "kwargs"}
    assert documented_parameters("No section.\n\nx : int\n") == set()


def test_a_missing_docstring_or_parameter_is_found():
    def documented(a, *rest, b=1, **kwargs):
        """Documented.

        Parameters
        ----------
        a : int
        *rest
        b : int, default 1
        **kwargs
        """

    def undocumented(a, b):
        """One parameter only.

        Parameters
        ----------
        a : int
        """

    def bare(a):
        pass

    assert check_function("documented", documented) == []
    assert check_function("undocumented", undocumented) == [
        "undocumented: the Parameters section does not name b"]
    assert check_function("bare", bare) == ["bare: no docstring"]

    class Thing:
        """A thing.

        Parameters
        ----------
        size : int
        """

        def __init__(self, size, name):
            pass

        def grow(self, by):
            """Grow."""

        @property
        def area(self):
            return 0

    Thing.__module__ = "stepnet.fake"
    assert check_class("Thing", Thing) == [
        "Thing(): the Parameters section does not name name",
        "Thing.grow: the Parameters section does not name by",
        "Thing.area: no docstring",
    ]


# ---------------------------------------------------------------------------
# the API


# names still being documented, one a line; the list may only shrink
PENDING_FILE = Path(__file__).with_name("api_docs_pending.txt")


def pending() -> set[str]:
    return {line.strip() for line in PENDING_FILE.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def _subject(problem: str) -> str:
    return problem.split(": ")[0]


@pytest.mark.parametrize("package", PACKAGES)
def test_public_api_is_documented(package):
    """Each package's public names and their parameters are documented (NumPy style)."""
    if not _available(package):
        pytest.skip(f"{package} needs {OPTIONAL[package]}")
    problems = api_problems([package])
    new = [p for p in problems if _subject(p) not in pending()]
    assert not new, f"{len(new)} documentation gaps in {package}:\n" + "\n".join(new)
    subjects = {_subject(p) for p in problems}
    closed = sorted(name for name in pending() if _package_of(name) == package and name not in subjects)
    assert not closed, (f"documented now: remove from {PENDING_FILE.name}: " + ", ".join(closed))


def _package_of(name: str) -> str:
    """The longest of ``PACKAGES`` that ``name`` lies in."""
    return max((p for p in PACKAGES if name == p or name.startswith(p + ".")), key=len)
