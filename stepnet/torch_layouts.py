"""stepnet.torch's tensors: where each row of a LoD lies in the caller's
tensor (padded, packed or as the LoD's own rows), and torch tensors checked
and seen as numpy arrays (and back) without a copy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from .errors import LoDError, ShapeError, UnsupportedError
from .lod import LoDTensor, offsets_from_lengths
from .padded import lod_lengths, mask, rows_at_steps

TORCH_DTYPES = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
                np.dtype(np.float64): torch.float64}
NUMPY_DTYPES = {t: n for n, t in TORCH_DTYPES.items()}


# ----------------------------------------------------------------------------
# layouts: where each row of a one-level LoD lies in the caller's tensor


class Layout:
    """How the rows of a LoD (caller's sequence order, each sequence's steps
    in order) lie in the caller's tensor.

    ``kind`` is ``"padded"`` (``[B, T1, ..., Td, ...]`` batch-first, one
    axis per level), ``"packed"`` (a ``PackedSequence``'s data, one level)
    or ``"rows"`` (the LoD's own rows). ``index`` gives, for each LoD row,
    its row in the caller's tensor flattened to ``[rows, ...]`` (``None``:
    the same row).
    """

    def __init__(self, kind, levels, index=None, padded_shape=None, packed=None, lengths=None):
        self.kind = kind
        self.levels = levels  # the LoD's offset levels
        self.index = index
        self.padded_shape = padded_shape  # (B, T1, ..., Td) for "padded"
        self.packed = packed  # the PackedSequence that came in, for "packed"
        self.lengths = lengths  # for "padded": each level's lengths, padded ([B], [B, T1], ...)

    @property
    def caller_rows(self):
        if self.kind == "padded":
            return int(np.prod(self.padded_shape))
        if self.kind == "packed":
            return int(self.packed.data.shape[0])
        return int(self.levels[-1][-1])

    def gather(self, array):
        """The caller's tensor (as an array) to LoD rows."""
        axes = len(self.padded_shape) if self.kind == "padded" else 1
        flat = array.reshape((self.caller_rows,) + array.shape[axes:])
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

    def of_levels(self, levels):
        """This layout for a LoD of ``levels`` (offsets): itself where they
        are its own, that of its first levels where they are those of a
        padded one (a nested net's input, and its enclosing net's all-steps
        output); None where the LoD is another."""
        if self.kind == "rows" or len(levels) > len(self.levels) or not all(
                np.array_equal(a, b) for a, b in zip(levels, self.levels)):
            return None
        if len(levels) == len(self.levels):
            return self
        d = len(levels)
        return padded_layout(self.padded_shape[:d + 1], self.lengths[:d], "an output")

    def over_rows(self, memory, levels):
        """For a LoD of ``levels`` that is this padded one-level layout's
        steps, each with its sequence's rows of the ragged static input laid
        out as ``memory`` (attention weights over a memory): the layout
        ``[B, T, M]``, ``M`` the memory's padded length (its longest where it
        is not padded); else None."""
        if self.kind != "padded" or len(self.levels) != 1 or len(levels) != 2 or \
                not np.array_equal(levels[0], self.levels[0]):
            return None
        rows = np.diff(memory.levels[0])
        if not np.array_equal(np.diff(levels[1]), np.repeat(rows, np.diff(self.levels[0]))):
            return None
        width = memory.padded_shape[1] if memory.kind == "padded" else int(rows.max(initial=0))
        per_step = rows_at_steps(self.lengths[0], self.padded_shape, rows)
        return padded_layout(self.padded_shape + (width,), (self.lengths[0], per_step),
                             "an output")

    def wrap(self, data):
        """An output tensor in the caller's form (a PackedSequence for packed)."""
        if self.kind == "packed":
            p = self.packed
            return PackedSequence(data, p.batch_sizes, p.sorted_indices, p.unsorted_indices)
        if self.kind == "rows":
            return data, [level.tolist() for level in self.levels]
        return data


def padded_layout(shape, lengths, what):
    """A ``[B, T1, ..., Td, ...]`` tensor of a LoD of ``d = len(lengths)``
    levels: ``lengths`` the lengths of each (``[B]``, ``[B, T1]``, ...; see
    ``stepnet.padded``), None each for every entry full (a one-level
    ``[B, T, ...]``: ``(None,)``)."""
    lens = []
    for i, given in enumerate(lengths):
        at = shape[:i + 1]
        name = "lengths" if len(lengths) == 1 else f"lengths[{i}]"
        lens.append(np.full(at, shape[i + 1], np.int64) if given is None
                    else lengths_array(given, f"{what}: {name}", at, shape[i + 1]))
    found = mask(lens, shape)
    index = None if found.all() else np.flatnonzero(found.ravel())
    levels = tuple(offsets_from_lengths(n) for n in lod_lengths(lens))
    return Layout("padded", levels, index, tuple(int(n) for n in shape[:len(lens) + 1]),
                  lengths=lens)


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


def lengths_array(lengths, what, shape, steps):
    """``lengths`` as int64 of ``shape`` (``[B]``, or a deeper level's
    ``[B, T1, ...]``), each in ``[0, steps]``."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    lens = np.asarray(lengths)
    if lens.ndim != len(shape) or (lens.size and lens.dtype.kind not in "iu"):
        raise ShapeError(f"{what} must be {len(shape)}-D integers, got {lens.dtype} of shape "
                         f"{list(lens.shape)}")
    if lens.shape != tuple(shape):
        raise ShapeError(f"{what} has shape {list(lens.shape)} for a padded tensor of "
                         f"{list(shape)} (its entries)")
    bad = np.argwhere((lens < 0) | (lens > steps))
    if bad.size:
        i = tuple(int(k) for k in bad[0])
        raise ShapeError(f"{what}[{', '.join(map(str, i))}] = {int(lens[i])} is outside "
                         f"[0, {steps}] (the padded tensor has {steps} there)")
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
