"""Every setting stepnet reads, in one place: ``sn.config``.

A setting comes from, first to last: the innermost ``with sn.config(...)``
block that sets it, its environment variable (``STEPNET_*``), its default.
No other module reads a ``STEPNET_*`` variable; docs/environment.md is
:func:`describe`'s table.

    import stepnet as sn
    sn.config.tiered                     # True: what is in effect now
    with sn.config(tiered=False, debug=True):
        layer(x)                         # waits for the kernel, prints its source
    print(sn.config)                     # every setting, its value and where it came from

A block sets its values for the whole process (every thread) while it runs.
Settings marked "engine" are read once, when the Numba engine starts (the
first compile on it, or ``stepnet info``), and hold for the rest of the
process: the kernels' helpers are compiled against them. A block that asks
for another value of one after that raises :class:`~stepnet.errors.StepNetError`
rather than being ignored.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from .errors import StepNetError, UnsupportedError

BLAS_CHOICES = ("openblas", "mkl", "numpy")


def _switch(default: bool):
    """A setting that is on or off: the variable's ``0`` is off, any other
    non-empty value on; a block gives a bool."""
    def value(raw, where):
        if where.startswith("STEPNET_"):
            return default if raw == "" else raw != "0"
        if isinstance(raw, bool):
            return raw
        raise UnsupportedError(f"{where}: expected True or False")
    return value


def _choice(choices, default):
    """A setting that is one of ``choices`` (any case); unset: ``default``."""
    def value(raw, where):
        if raw is None or raw == "":
            return default
        if isinstance(raw, str) and raw.lower() in choices:
            return raw.lower()
        raise UnsupportedError(f"{where}: expected one of {', '.join(choices)}")
    return value


FIRST_TIERS = ("executor", "interpreter")


def _rows(raw, where):
    if raw is None or raw == "":
        return None
    if where.startswith("STEPNET_") and raw.isascii() and raw.isdigit():
        raw = int(raw)
    if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 2**62:  # (an int64)
        return raw
    raise UnsupportedError(f"{where}: expected a number of rows (an integer >= 0)")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def machine_memory() -> int:
    """The machine's physical memory in bytes (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 0


def _bytes(raw, where):
    if raw is None or raw == "":
        return None
    if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
        return raw
    if isinstance(raw, str):
        text = raw.strip().replace(" ", "").lower()
        number = text.rstrip("kmgtib")
        unit = text[len(number):]
        try:
            value = float(number) * _UNITS[unit]
        except (KeyError, ValueError):
            value = 0
        if 1 <= value < float("inf"):  # (not nan either)
            return int(value)
    raise UnsupportedError(f"{where}: expected a number of bytes > 0, or one with a unit "
                           "(512MiB, 8GiB, 1.5GB)")


def _directory(raw, where):
    if raw is None or raw == "":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return _not_a_file((Path(base) / "stepnet").absolute(), where)
    if isinstance(raw, (str, os.PathLike)):  # (absolute: the compile worker runs in another folder)
        return _not_a_file(Path(raw).expanduser().absolute(), where)
    raise UnsupportedError(f"{where}: expected a directory")


def _not_a_file(path, where):
    """``path``, where it is or can be a directory: said here, naming the
    setting, not by the first file written there. (A read-only one is
    taken: a deployment's, filled ahead by ``stepnet compile``.)"""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise UnsupportedError(f"{where}: {existing} is a file, not a directory")
    return path


@dataclass(frozen=True)
class Flag:
    """One setting: ``sn.config.<name>``, read from ``env``."""
    name: str
    env: str
    default: str  # as the docs show it
    value: Callable  # (environment text or a block's value, where) -> the value
    read: str  # "use": at each use; "engine": once, when the Numba engine starts
    effect: str


FLAGS = (
    Flag("cache_dir", "STEPNET_CACHE_DIR", "`$XDG_CACHE_HOME/stepnet`, else `~/.cache/stepnet`",
         _directory, "use",
         "The directory of everything stepnet writes: the compiled kernels and their helpers, "
         "`blas.json` (the BLAS measurements), `small_products.json`, "
         "`small_products_float64.json` and `transposed_products.json` (the product "
         "measurements). Also the compile worker's lock, "
         "socket and status (`compile_worker.*`): one worker per directory; the compile worker "
         "of the tiered backend gets the same directory. Copies of the same stepnet (a checkout "
         "and its installed copy, two environments) share what they compiled there."),
    Flag("tiered", "STEPNET_TIERED", "on (`1`)", _switch(True), "use",
         "`0`: a new kernel's first call waits for its compilation. Otherwise a kernel that no "
         "process has compiled on this machine answers its first calls on the first tier "
         "(`STEPNET_FIRST_TIER`) while the compile worker (one per `STEPNET_CACHE_DIR`, shared "
         "by every process using it) compiles it "
         "([internals](internals.md#tiers-a-first-result-without-waiting-for-the-compile)). "
         "Tiers are always off under `STEPNET_DETERMINISTIC`."),
    Flag("first_tier", "STEPNET_FIRST_TIER", "`executor`", _choice(FIRST_TIERS, "executor"), "use",
         "What answers a new kernel's first calls while it compiles: `executor` (the schedule "
         "executor, `stepnet/executor.py`: the step-net's schedule on loops compiled once per "
         "install; the interpreter for a step-net it does not run) or `interpreter` (the NumPy "
         "reference); any other value raises `UnsupportedError`."),
    Flag("deterministic", "STEPNET_DETERMINISTIC", "off", _switch(False), "engine",
         "Any value other than empty or `0`: every matrix product runs stepnet's own loop in a "
         "fixed order, without reassociation or FMAs, so each row's result does not depend on "
         "the other rows of the batch (a distributed run equals a single-process one bit for "
         "bit); slower. Also turns tiers off. Kernels compiled with it are cached apart from "
         "the others."),
    Flag("blas", "STEPNET_BLAS", "measured", _choice(BLAS_CHOICES, None), "engine",
         "The BLAS the Numba kernels call: `openblas` (SciPy's), `mkl` or `numpy` (`np.dot`); "
         "any other value raises `UnsupportedError`. A named library that is not found falls "
         "back to `numpy` with a warning. Unset or empty: stepnet measures the libraries it "
         "finds once per machine and keeps the choice in `STEPNET_CACHE_DIR/blas.json`. "
         "Kernels are cached per choice. `stepnet info` prints the choice."),
    Flag("small_products", "STEPNET_SMALL_PRODUCTS", "measured", _rows, "engine",
         "A number of rows (an integer >= 0): products of up to that many rows run stepnet's own "
         "loop instead of the BLAS, for every size of weights; anything else raises "
         "`UnsupportedError`. Unset or empty: the limits are measured once per machine, "
         "library and dtype (float32; float64 at a first float64 kernel) and kept in "
         "`STEPNET_CACHE_DIR/small_products.json` (`small_products_float64.json`). Ignored under "
         "`STEPNET_DETERMINISTIC`."),
    Flag("malloc_tuning", "STEPNET_MALLOC_TUNING", "on (`1`)", _switch(True), "engine",
         "`0`: leave glibc's malloc settings alone. Otherwise the Numba engine raises glibc's "
         "mmap threshold to 32 MiB and its trim threshold to 256 MiB, so that freed arrays are "
         "reused by the next call; it does so only where glibc is the C library and neither "
         "`GLIBC_TUNABLES` nor any `MALLOC_*` variable is set."),
    Flag("max_memory", "STEPNET_MAX_MEMORY", "the machine's memory", _bytes, "use",
         "The most memory one array stepnet makes for a model or a call may take (a "
         "parameter, an input made from a model's declared kinds, an output): bytes, or with a "
         "unit (`512MiB`, `8GiB`, `1.5GB`). Larger ones raise `SizeError` before anything is "
         "allocated, naming the array and the amount; a call's outputs are checked from 16 MiB "
         "in all (reading the setting at every call would cost more than it saves)."),
    Flag("debug", "STEPNET_DEBUG", "off", _switch(False), "use",
         "Any value other than empty or `0`: print the generated source of each kernel to "
         "stderr when it is made (every backend)."),
)
_BY_NAME = {flag.name: flag for flag in FLAGS}
_READ = {"use": "at each use", "engine": "when the Numba engine starts"}


class _Block:
    """``with sn.config(...)``: the values in effect while the block runs."""

    def __init__(self, config, values):
        self._config, self._values = config, values
        self._entered = threading.local()  # this thread's entries of the block, innermost last

    def __enter__(self):
        self._entered.__dict__.setdefault("stack", []).append(self._config._push(self._values))
        return self._config

    def __exit__(self, *exc):
        self._config._pop(self._entered.stack.pop())


class Config:
    """stepnet's settings (the module docstring): ``sn.config.<name>`` reads
    one, ``with sn.config(name=value): ...`` sets some for a block.

    Parameters
    ----------
    **settings
        Calling it (``sn.config(tiered=False)``) makes a block of these
        values: ``cache_dir`` (a directory), ``tiered``, ``first_tier``
        (``"executor"`` or ``"interpreter"``), ``deterministic``,
        ``malloc_tuning`` and ``debug`` (True or False), ``blas``
        (``"openblas"``, ``"mkl"``, ``"numpy"`` or None: measured),
        ``small_products`` (a number of rows, or None: measured). A wrong name
        or value raises ``UnsupportedError`` when the block is made.
    """

    def __init__(self):
        object.__setattr__(self, "_blocks", [])  # the dicts of the blocks running, innermost last
        object.__setattr__(self, "_started", {})  # engine setting -> the value it started with
        object.__setattr__(self, "_lock", threading.Lock())

    def __getattr__(self, name):
        flag = _BY_NAME.get(name)
        if flag is None:
            raise AttributeError(f"sn.config has no setting {name!r}; the settings: "
                                 f"{', '.join(_BY_NAME)}")
        return self._lookup(flag)[0]

    def __setattr__(self, name, value):
        raise StepNetError(f"sn.config.{name} = ...: set it for a block, `with sn.config("
                           f"{name}=...):`, or in the environment")

    def __call__(self, **settings) -> _Block:
        values = {}
        for name, raw in settings.items():
            flag = _BY_NAME.get(name)
            if flag is None:
                raise UnsupportedError(f"sn.config({name}=...): no such setting; the settings: "
                                       f"{', '.join(_BY_NAME)}")
            values[name] = flag.value(raw, f"sn.config({name}={raw!r})")
        return _Block(self, values)

    def _lookup(self, flag):
        """(value, where it came from)."""
        with self._lock:
            for block in reversed(self._blocks):
                if flag.name in block:
                    return block[flag.name], "block"
        text = os.environ.get(flag.env, "").strip()
        return flag.value(text, f"{flag.env}={text!r}"), (flag.env if text else "default")

    def _push(self, values):
        with self._lock:
            for name, value in values.items():
                if name in self._started and self._started[name] != value:
                    raise StepNetError(
                        f"sn.config({name}={value!r}): the Numba engine of this process started "
                        f"with {name}={self._started[name]!r}, and {name} is read once, when it "
                        f"starts: set it before the first compile, or in {_BY_NAME[name].env}")
            entry = dict(values)  # (one per entry: a block entered twice, or by two threads)
            self._blocks.append(entry)
            return entry

    def _pop(self, entry):
        with self._lock:
            # (by identity: blocks of two threads may end in any order)
            self._blocks[:] = [b for b in self._blocks if b is not entry]

    def engine(self, name):
        """The value of an "engine" setting the Numba engine runs with: the one
        it started with, or, if it has not started, the one it would."""
        flag = _BY_NAME[name]
        assert flag.read == "engine", name
        with self._lock:
            if name in self._started:
                return self._started[name]
        return self._lookup(flag)[0]

    def start_engine(self, name):
        """The value of the "engine" setting ``name`` for the rest of the
        process (called as the Numba engine starts)."""
        value = self.engine(name)
        with self._lock:
            return self._started.setdefault(name, value)

    def __repr__(self):
        lines = []
        for flag in FLAGS:
            value, where = self._lookup(flag)
            line = f"{flag.name} = {value!r}  ({where}; {flag.env})"
            if flag.name in self._started and self._started[flag.name] != value:
                line += f"; the Numba engine started with {self._started[flag.name]!r}"
            lines.append(line)
        return "\n".join(lines)


config = Config()


def describe() -> str:
    """docs/environment.md's table of the settings."""
    lines = ["| variable | `sn.config` | default | read | effect |", "|---|---|---|---|---|"]
    for flag in FLAGS:
        lines.append(f"| `{flag.env}` | `{flag.name}` | {flag.default} | {_READ[flag.read]} | "
                     f"{flag.effect} |")
    return "\n".join(lines)
