"""stepnet.torch's tensors: where each row of a one-level LoD lies in the
caller's tensor (padded, packed or as the LoD's own rows), and torch tensors
checked and seen as numpy arrays (and back) without a copy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from .errors import LoDError, ShapeError, UnsupportedError
from .lod import LoDTensor, offsets_from_lengths

TORCH_DTYPES = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
                np.dtype(np.float64): torch.float64}
NUMPY_DTYPES = {t: n for n, t in TORCH_DTYPES.items()}


# ----------------------------------------------------------------------------
# layouts: where each row of a one-level LoD lies in the caller's tensor


class Layout:
    """How the rows of a one-level LoD (caller's sequence order, each
    sequence's steps in order) lie in the caller's tensor.

    ``kind`` is ``"padded"`` (``[B, T, ...]`` batch-first), ``"packed"``
    (a ``PackedSequence``'s data) or ``"rows"`` (the LoD's own rows).
    ``index`` gives, for each LoD row, its row in the caller's tensor
    flattened to ``[rows, ...]`` (``None``: the same row).
    """

    def __init__(self, kind, levels, index=None, padded_shape=None, packed=None):
        self.kind = kind
        self.levels = levels  # the LoD's offset levels
        self.index = index
        self.padded_shape = padded_shape  # (B, T) for "padded"
        self.packed = packed  # the PackedSequence that came in, for "packed"

    @property
    def caller_rows(self):
        if self.kind == "padded":
            return self.padded_shape[0] * self.padded_shape[1]
        if self.kind == "packed":
            return int(self.packed.data.shape[0])
        return int(self.levels[-1][-1])

    def gather(self, array):
        """The caller's tensor (as an array) to LoD rows."""
        flat = array.reshape((self.caller_rows,) + array.shape[2 if self.kind == "padded" else 1:])
        if self.index is None:
            return np.ascontiguousarray(flat)
        return flat[self.index]

    def scatter(self, rows):
        """LoD rows to an array in the caller's layout (zeros where padding)."""
        features = rows.shape[1:]
        if self.index is None:
            out = rows
        else:
            make = np.empty if self.kind == "packed" else np.zeros  # packed rows are all tokens
            out = make((self.caller_rows,) + features, rows.dtype)
            out[self.index] = rows
        if self.kind == "padded":
            return out.reshape(tuple(self.padded_shape) + features)
        return out

    def wrap(self, data):
        """An output tensor in the caller's form (a PackedSequence for packed)."""
        if self.kind == "packed":
            p = self.packed
            return PackedSequence(data, p.batch_sizes, p.sorted_indices, p.unsorted_indices)
        if self.kind == "rows":
            return data, [level.tolist() for level in self.levels]
        return data


def padded_layout(shape, lengths, what):
    """A ``[B, T, ...]`` tensor; ``lengths`` None: every sequence T steps."""
    B, T = int(shape[0]), int(shape[1])
    if lengths is None:
        lens = np.full(B, T, np.int64)
    else:
        lens = lengths_array(lengths, what)
        if lens.shape != (B,):
            raise ShapeError(f"{what}: lengths has {lens.size} entries for {B} sequences "
                             f"(the padded tensor is {list(shape)})")
        bad = np.flatnonzero((lens < 0) | (lens > T))
        if bad.size:
            i = int(bad[0])
            raise ShapeError(f"{what}: lengths[{i}] = {int(lens[i])} is outside [0, {T}] "
                             f"(the padded tensor has {T} steps)")
    index = None
    if not np.all(lens == T):
        index = np.flatnonzero((np.arange(T) < lens[:, None]).ravel())
    return Layout("padded", (offsets_from_lengths(lens),), index, (B, T))


def packed_layout(packed, what):
    """A PackedSequence: rows in the caller's order (``unsorted_indices``), so
    initial and final states need no permutation."""
    if packed.batch_sizes.device.type != "cpu":
        raise ShapeError(f"{what}: batch_sizes must be on the CPU")
    sizes = packed.batch_sizes.numpy().astype(np.int64)
    steps = sizes.size
    batch = int(sizes[0]) if steps else 0
    # a sorted sequence s has as many steps as there are batch sizes above s
    sorted_lengths = steps - np.searchsorted(sizes[::-1], np.arange(batch), side="right")
    if packed.unsorted_indices is None:
        position = np.arange(batch)
    else:
        position = packed.unsorted_indices.cpu().numpy().astype(np.int64)
    lengths = sorted_lengths[position]
    offsets = offsets_from_lengths(lengths)
    step = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
    first_row = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    index = first_row[step] + np.repeat(position, lengths)
    return Layout("packed", (offsets,), index, packed=packed)


def rows_layout(rows, lod, what):
    try:
        levels = LoDTensor(np.empty((rows.shape[0], 0)), lod).levels
    except LoDError as exc:
        raise ShapeError(f"{what}: {exc}") from None
    return Layout("rows", levels)


def lengths_array(lengths, what):
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    lens = np.asarray(lengths)
    if lens.ndim != 1 or (lens.size and lens.dtype.kind not in "iu"):
        raise ShapeError(f"{what}: lengths must be a 1-D sequence of integers, got "
                         f"{lens.dtype} of shape {list(lens.shape)}")
    return lens.astype(np.int64)


def is_lod_levels(value):
    """A list of offset levels (``[[0, 2, 5], ...]``), told from lengths."""
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(level, (list, tuple, np.ndarray)) for level in value))


# ----------------------------------------------------------------------------
# tensors and arrays


def check_tensor(t, what, dtype=None):
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{what}: expects a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise UnsupportedError(f"{what}: is on {t.device}; stepnet.torch runs on CPU tensors "
                               "(move it with .cpu())")
    if dtype is not None and t.dtype != dtype:
        raise ShapeError(f"{what}: has dtype {t.dtype}, the stepnet net computes in {dtype}; "
                         f"cast it (.to({dtype}))")
    elif t.dtype not in NUMPY_DTYPES:
        raise ShapeError(f"{what}: dtype {t.dtype} is not float16, float32 or float64")
    return t


def as_array(t):
    """A tensor's memory as an ndarray (no copy)."""
    return t.detach().numpy()


def as_tensor(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def grad_array(g):
    return None if g is None else as_array(g)


def data_pointer(a):
    return a.__array_interface__["data"][0]
