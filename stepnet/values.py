"""The values of the step-net IR (:mod:`stepnet.ir`): a :class:`Var` (a typed
value of the graph) and a :class:`Literal` (a Python scalar operand).

They live apart from the equations and blocks so that the op registry, whose
shape rules read them, sits below the IR: values <- registry <- ir.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Var:
    """One value of the graph. Identity is the object itself."""

    name: str
    dtype: np.dtype
    shape: tuple  # full shape; shape[0] is None for per-sequence (batched) values
    lod_depth: int = 0  # > 0: ragged rows, a `lod_depth`-level LoD under each batch row

    @property
    def batched(self) -> bool:
        return len(self.shape) > 0 and self.shape[0] is None

    @property
    def row_shape(self) -> tuple:
        """The shape of one row: the full shape without the batch axis."""
        return self.shape[1:] if self.batched else self.shape

    def type_str(self) -> str:
        dims = ",".join("B" if d is None else str(d) for d in self.shape)
        lod = f"lod{self.lod_depth}" if self.lod_depth else ""
        return f"{_dtype_short(self.dtype)}{lod}[{dims}]"

    def __repr__(self):
        return f"{self.name}:{self.type_str()}"


@dataclass(frozen=True)
class Literal:
    """A Python scalar operand; weakly typed (NEP 50): it never promotes."""

    value: float

    def __repr__(self):
        return repr(self.value)


def _dtype_short(dtype) -> str:
    dtype = np.dtype(dtype)
    return {"f": "f", "i": "i", "u": "u", "b": "bool"}.get(dtype.kind, dtype.kind) + (
        "" if dtype.kind == "b" else str(dtype.itemsize * 8)
    )
