"""Sizes checked before anything is allocated: an array that would take more
memory than the machine has (or than ``sn.config.max_memory`` allows) is
refused with :class:`~stepnet.errors.SizeError`, naming it and the amount,
instead of a NumPy ``MemoryError`` or the machine swapping."""

from __future__ import annotations

import math

import numpy as np

from .config import config, machine_memory
from .errors import SizeError


def human(size: int) -> str:
    """``size`` bytes for a message: ``149 GiB``, ``3.2 MiB``, ``12 bytes``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
    return f"{size} bytes"


def limit() -> tuple:
    """``(bytes, what they are)``: the most one array may take."""
    asked = config.max_memory
    if asked is not None:
        return asked, f"sn.config.max_memory ({human(asked)}; STEPNET_MAX_MEMORY)"
    memory = machine_memory()
    return (memory, f"this machine's memory ({human(memory)})") if memory else (None, "")


def check(what: str, shape, dtype) -> None:
    """Raise :class:`SizeError` if an array ``what`` of ``shape`` and
    ``dtype`` would take more than :func:`limit`. ``dtype`` None: of an
    unknown type, so at least a byte an element."""
    size = np.dtype(dtype).itemsize if dtype is not None else 1
    need = math.prod(int(d) for d in shape) * size
    most, said = limit()
    if most is not None and need > most:
        kind = np.dtype(dtype) if dtype is not None else "(a byte an element at least)"
        raise SizeError(f"{what} {[int(d) for d in shape]} {kind} needs {human(need)}, "
                        f"more than {said}")


# arrays under this many bytes are not checked where a check would cost every
# call (a call's outputs, an ONNX op's): microseconds saved, and no machine
# has so little memory
CHECKED_FROM = 1 << 24


def check_large(what: str, shape, dtype) -> None:
    """:func:`check` where the array would take ``CHECKED_FROM`` bytes or
    more (what a value read from a file asks for: a few bytes of it can
    ask for terabytes)."""
    if math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize >= CHECKED_FROM:
        check(what, shape, dtype)


def check_all(what: str, arrays) -> None:
    """Raise :class:`SizeError` if the arrays ``[(name, shape, dtype)]``
    that one call makes (``what``: ``"the outputs of step-net 'gru'"``)
    would take more than :func:`limit` together, naming the largest."""
    needs = [(math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize, name, shape, dtype)
             for name, shape, dtype in arrays]
    most, said = limit()
    total = sum(n for n, *_ in needs)
    if most is not None and total > most:
        need, name, shape, dtype = max(needs, key=lambda n: n[0])
        raise SizeError(f"{what} need {human(total)}, more than {said}; the largest, {name} "
                        f"{[int(d) for d in shape]} {np.dtype(dtype)}, {human(need)}")
