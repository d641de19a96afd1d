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
    ``dtype`` would take more than :func:`limit`."""
    need = math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
    most, said = limit()
    if most is not None and need > most:
        raise SizeError(f"{what} {[int(d) for d in shape]} {np.dtype(dtype)} needs {human(need)}, "
                        f"more than {said}")
