"""LoD tensors: a batch of variable-length sequences, nested to any depth.

A :class:`LoDTensor` is a dense array ``data`` of shape ``[N, ...]`` plus a
LoD ("level of detail"): a list of *offset* levels, coarsest first, in
PaddlePaddle's internal form.

* Level ``k`` is a list of offsets that starts at 0 and never decreases.
  Entry ``i`` of level ``k`` spans the entries ``lod[k][i]:lod[k][i + 1]`` of
  level ``k + 1``, so level ``k``'s last offset equals the number of entries
  of level ``k + 1`` (``len(lod[k + 1]) - 1``).
* The last level's offsets index rows of ``data``; its last offset equals
  ``N``.

Example, 2 chapters / 5 paragraphs / 14 words::

    lod = [[0, 2, 5], [0, 3, 5, 9, 10, 14]]

Chapter 0 is paragraphs 0-1 (words 0-4), chapter 1 is paragraphs 2-4
(words 5-13).  The same LoD as *lengths* (Paddle's "recursive sequence
lengths") is ``[[2, 3], [3, 2, 4, 1, 4]]``.  Empty sequences (length 0) are
legal at every level.

Every constructor validates its input and raises
:class:`stepnet.errors.LoDError` with a message naming the level and the
offset (or index) at fault.
"""

from __future__ import annotations

import numbers
import operator

import numpy as np

from stepnet.errors import LoDError
from stepnet.sizes import check_large

__all__ = [
    "LoDTensor",
    "lengths_from_offsets",
    "offsets_from_lengths",
    "row_range",
]

_INT64_MAX = np.iinfo(np.int64).max


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _show(x):
    """Format one offending value for an error message (NumPy scalars plain)."""
    if isinstance(x, np.generic):
        x = x.item()
    return repr(x)


def _int_array(values, where, item, noun, scalar_hint=""):
    """Convert ``values`` to a 1-D int64 array or raise a LoDError.

    ``where`` starts the message (e.g. ``"lod level 1"``), ``item`` names one
    element (``"offset"`` or ``"index"``) and ``noun`` the elements in plural
    (``"offsets"`` or ``"lengths"``); ``scalar_hint`` is added when a scalar
    was given.  Bools and floats are refused, even integral floats: offsets
    and lengths are counts.
    """
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError):
        raise LoDError(f"{where}: must be a 1-D sequence of {noun} "
                       f"(got a ragged or malformed {type(values).__name__})") from None
    if arr.ndim != 1:
        if arr.ndim == 0:
            got = _show(arr[()])
            hint = scalar_hint
        else:
            got = f"an array of shape {arr.shape}"
            hint = ""
        raise LoDError(f"{where}: must be a 1-D sequence of {noun} (got {got}){hint}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "i" and not _has_bool(values):  # (a bool among ints: named below)
        return arr.astype(np.int64)
    if arr.dtype.kind == "u":
        too_big = np.flatnonzero(arr > _INT64_MAX)
        if too_big.size:
            i = int(too_big[0])
            raise LoDError(f"{where}, {item} {i}: {noun} must fit in int64 "
                           f"(got {_show(arr[i])})")
        return arr.astype(np.int64)
    if not isinstance(values, (list, tuple)):
        raise LoDError(f"{where}: {noun} must be integers (got an array of dtype {arr.dtype})")
    # A list or tuple: name its first element that is not an integer.
    for i, x in enumerate(values):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
            raise LoDError(f"{where}, {item} {i}: {noun} must be integers (got {_show(x)})")
        if not -_INT64_MAX - 1 <= int(x) <= _INT64_MAX:
            raise LoDError(f"{where}, {item} {i}: {noun} must fit in int64 (got {_show(x)})")
    return np.array([int(x) for x in values], dtype=np.int64)


def _has_bool(values) -> bool:
    """Whether a list or tuple holds a bool (NumPy takes ``[0, True]`` for ints)."""
    return isinstance(values, (list, tuple)) and any(isinstance(x, (bool, np.bool_)) for x in values)


def _finest(k):
    """How an error names level ``k``, the finest of a LoD (it counts data rows)."""
    return "the only level" if k == 0 else "the finest"


def _as_levels(levels, what):
    """Turn a ``lod`` or ``lengths`` argument into a list of its levels."""
    if levels is None:
        return []
    if isinstance(levels, (str, bytes, dict)):
        raise LoDError(f"{what} must be a list of levels (got {type(levels).__name__})")
    try:
        return list(levels)
    except TypeError:
        raise LoDError(f"{what} must be a list of levels "
                       f"(got {type(levels).__name__})") from None


def _total(lengths, where):
    """The sum of non-negative int64 ``lengths``, exact (NumPy's sum would
    wrap around past int64's range, which is refused)."""
    if lengths.size and int(lengths.max()) > _INT64_MAX // lengths.size:
        total = sum(int(n) for n in lengths)  # (lengths this large: summed exactly)
        if total > _INT64_MAX:
            raise LoDError(f"{where}: lengths sum to {total}, past the largest row count "
                           f"({_INT64_MAX})")
        return total
    return int(lengths.sum())


def _rows_array(value, what):
    """``value`` as an array (not a LoDTensor, nor rows of several shapes)."""
    if isinstance(value, LoDTensor):
        raise TypeError(f"{what} is already a LoDTensor; pass its .data (and its .lod) to build "
                        "a new one")
    try:
        return np.asarray(value)
    except ValueError as exc:
        raise LoDError(f"{what} must be an array of rows of one shape: {exc}") from None


def _frozen(arr):
    """``arr`` as a read-only int64 array that cannot be made writeable again,
    nor its base: a copy over immutable bytes. (A LoDTensor's offsets are
    checked once, when it is made, and compiled kernels index rows by them.)"""
    return np.frombuffer(np.ascontiguousarray(arr, dtype=np.int64).tobytes(), dtype=np.int64)


def device_array(value):
    """``value`` as a ``numba.cuda`` device array where it lies on a GPU (a
    numba device array, or any object with ``__cuda_array_interface__``: a
    torch CUDA tensor, a CuPy array; a view, not a copy), else None.
    ``numba.cuda`` is imported only for the latter."""
    if isinstance(value, (np.ndarray, np.generic, LoDTensor)) or not (
            hasattr(value, "copy_to_host") or hasattr(value, "__cuda_array_interface__")):
        return None
    if hasattr(value, "copy_to_host"):  # a numba device array (the CUDA simulator's too)
        return value
    from numba import cuda

    return cuda.as_cuda_array(value)


def host_array(value):
    """``value`` as a NumPy array: a CUDA array (:func:`device_array`) is
    copied to the host, anything else goes through ``np.asarray``."""
    device = device_array(value)
    return np.asarray(value) if device is None else device.copy_to_host()


def _concat_ranges(starts, stops):
    """Concatenate ``range(starts[i], stops[i])`` for every i, vectorized.

    >>> _concat_ranges(np.array([5, 0]), np.array([7, 3])).tolist()
    [5, 6, 0, 1, 2]
    """
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(stops, dtype=np.int64) - starts
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # Position of each output inside its own range, plus that range's start.
    first_out = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) + np.repeat(starts - first_out, lens)


def offsets_from_lengths(lengths):
    """Offsets (starting at 0) of consecutive segments of the given lengths.

    Raises LoDError naming the index of a negative or non-integer length.

    >>> offsets_from_lengths([3, 0, 2]).tolist()
    [0, 3, 3, 5]
    >>> offsets_from_lengths([]).tolist()
    [0]
    """
    lens = _int_array(lengths, "lengths", "index", "lengths")
    negative = np.flatnonzero(lens < 0)
    if negative.size:
        i = int(negative[0])
        raise LoDError(f"lengths, index {i}: lengths must be non-negative (got {int(lens[i])})")
    out = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def lengths_from_offsets(offsets):
    """Lengths of the segments between consecutive offsets (``np.diff``).

    >>> lengths_from_offsets([0, 3, 3, 5]).tolist()
    [3, 0, 2]
    """
    return np.diff(np.asarray(offsets, dtype=np.int64))


def row_range(lod_levels, level, start, stop):
    """Map the entries ``start:stop`` of ``level`` down to a range of data rows.

    ``lod_levels`` is a list of offset levels (as in ``LoDTensor.levels``).
    Entry ``i`` of level ``k`` covers entries ``lod[k][i]:lod[k][i + 1]`` of
    level ``k + 1``; applying that down to the last level gives rows.  With
    ``level == len(lod_levels)`` the range already is rows and comes back as is.

    >>> lod = [[0, 2, 5], [0, 3, 5, 9, 10, 14]]
    >>> row_range(lod, 0, 1, 2)      # chapter 1 -> words 5..13
    (5, 14)
    >>> row_range(lod, 1, 0, 3)      # paragraphs 0..2 -> words 0..8
    (0, 9)
    """
    start, stop = int(start), int(stop)
    for offsets in lod_levels[level:]:
        start, stop = int(offsets[start]), int(offsets[stop])
    return start, stop


def _format_level(offsets, limit=8):
    """Compact text of one level: long levels show their head and tail."""
    values = [int(v) for v in offsets]
    if len(values) <= limit:
        return "[" + ", ".join(map(str, values)) + "]"
    head = ", ".join(map(str, values[:3]))
    tail = ", ".join(map(str, values[-3:]))
    return f"[{head}, ..., {tail}]"


# ---------------------------------------------------------------------------
# LoDTensor
# ---------------------------------------------------------------------------


class LoDTensor:
    """A dense array ``[N, ...]`` with a LoD of offset levels, coarsest first.

    Parameters
    ----------
    data : array_like
        The rows ``[N, ...]``, converted with ``np.asarray`` (no copy when it
        already is an ndarray); at least one dimension. Not a LoDTensor:
        pass its ``.data`` (and its ``.lod``). An array on a GPU (a
        ``numba.cuda`` device array, or anything with
        ``__cuda_array_interface__``: a torch CUDA tensor, a CuPy array) stays
        there as a ``numba.cuda`` view (``on_device``): the CUDA backend reads
        it in place; the operations below that compute on the rows need
        :meth:`to_host` first.
    lod : list of sequence of int, optional
        The offset levels, coarsest first (see the module docstring): each
        starts at 0 and never decreases, each level ends at the number of
        entries of the next, and the last ends at ``N``. ``None`` or ``[]``
        means no levels, which is a valid tensor but not a batch of
        sequences: the sequence methods raise LoDError on it.

    Raises
    ------
    LoDError
        ``data`` is 0-d, or a level is malformed (not 1-D integers, empty,
        negative, not starting at 0, decreasing, or not ending where the
        next level or the data does); the message names the level and the
        offset at fault.
    TypeError
        ``data`` is a LoDTensor.

    Notes
    -----
    The levels are stored as read-only int64 arrays (``.levels``); ``.lod``
    returns them as fresh lists of Python ints.  ``len(t)`` is the number of
    top-level sequences (``t.num_sequences``), not the number of data rows
    (``t.shape[0]``).  ``==`` is object identity (not overridden).

    >>> t = LoDTensor(np.arange(14.0), [[0, 2, 5], [0, 3, 5, 9, 10, 14]])
    >>> t.num_sequences, t.lengths
    (2, [[2, 3], [3, 2, 4, 1, 4]])
    >>> t.sequence(1).lod
    [[0, 4, 5, 9]]
    >>> t.sequence(1).sequence(2).tolist()
    [10.0, 11.0, 12.0, 13.0]
    """

    __slots__ = ("_data", "_levels")

    def __init__(self, data, lod=None):
        device = device_array(data)
        data = _rows_array(data, "data") if device is None else device
        if data.ndim == 0:
            raise LoDError("data must have at least 1 dimension (got a 0-d array)")

        levels = []
        for k, level in enumerate(_as_levels(lod, "lod")):
            where = f"lod level {k}"
            offsets = _int_array(level, where, "offset", "offsets",
                                 "; a LoD is a list of levels, e.g. [[0, 2, 5]]")
            if offsets.size == 0:
                raise LoDError(f"{where}: must have at least 1 offset (got 0)")
            negative = np.flatnonzero(offsets < 0)
            if negative.size:
                i = int(negative[0])
                raise LoDError(f"{where}, offset {i}: offsets must be non-negative "
                               f"(got {int(offsets[i])})")
            if offsets[0] != 0:
                raise LoDError(f"{where}: must start at 0 (got {int(offsets[0])})")
            decreasing = np.flatnonzero(np.diff(offsets) < 0)
            if decreasing.size:
                i = int(decreasing[0]) + 1
                raise LoDError(f"{where}, offset {i}: offsets must be non-decreasing "
                               f"(got {int(offsets[i])} after {int(offsets[i - 1])})")
            levels.append(offsets)

        for k in range(len(levels) - 1):
            last, entries = int(levels[k][-1]), len(levels[k + 1]) - 1
            if last != entries:
                raise LoDError(f"lod level {k}: offsets end at {last} but level {k + 1} has "
                               f"{entries} entries")
        if levels:
            k = len(levels) - 1
            last, rows = int(levels[k][-1]), data.shape[0]
            if last != rows:
                raise LoDError(f"lod level {k} ({_finest(k)}): offsets end at {last} but the "
                               f"data has {rows} rows")

        self._data = data
        self._levels = tuple(_frozen(offsets) for offsets in levels)

    def __reduce__(self):
        # (pickled, copied and deep-copied through the checks of __init__,
        # which give the copy's levels back read-only)
        return type(self), (self._data, [np.asarray(o) for o in self._levels])

    @classmethod
    def _trusted(cls, data, levels):
        """A LoDTensor from parts already known to fit (stepnet's own slices
        and results of valid tensors): no checks; levels that are read-only
        int64 arrays are shared, not copied."""
        t = cls.__new__(cls)
        t._data = data
        t._levels = tuple(o if isinstance(o, np.ndarray) and o.dtype == np.int64
                          and not o.flags.writeable else _frozen(o) for o in levels)
        return t

    # -- construction ------------------------------------------------------

    @classmethod
    def from_lengths(cls, data, lengths):
        """Build from per-level lengths (Paddle's recursive sequence lengths).

        Parameters
        ----------
        data : array_like
            The rows ``[N, ...]``.
        lengths : list of sequence of int
            One level per LoD level, coarsest first. Level ``k`` has one
            non-negative length per entry of level ``k``; its sum must equal
            the number of entries of level ``k + 1`` (for the last level: the
            number of data rows ``N``).

        Returns
        -------
        LoDTensor
            ``data`` with the offsets that the lengths give.

        Raises
        ------
        LoDError
            A length is negative or not an integer, or a level's lengths do
            not sum to the size of the next level (or of the data).
        TypeError
            ``data`` is a LoDTensor.

        Examples
        --------
        >>> t = LoDTensor.from_lengths(np.zeros((14, 2)), [[2, 3], [3, 2, 4, 1, 4]])
        >>> t.lod
        [[0, 2, 5], [0, 3, 5, 9, 10, 14]]
        """
        device = device_array(data)  # (rows on the GPU stay there, as in __init__)
        data = _rows_array(data, "data") if device is None else device
        levels = []
        for k, level in enumerate(_as_levels(lengths, "lengths")):
            where = f"lengths level {k}"
            lens = _int_array(level, where, "index", "lengths",
                              "; lengths are a list of levels, e.g. [[2, 3]]")
            negative = np.flatnonzero(lens < 0)
            if negative.size:
                i = int(negative[0])
                raise LoDError(f"{where}, index {i}: lengths must be non-negative "
                               f"(got {int(lens[i])})")
            levels.append(lens)
        for k in range(len(levels) - 1):
            total, entries = _total(levels[k], f"lengths level {k}"), len(levels[k + 1])
            if total != entries:
                raise LoDError(f"lengths level {k}: lengths sum to {total} but level {k + 1} "
                               f"has {entries} entries")
        if levels and data.ndim >= 1:
            k = len(levels) - 1
            total, rows = _total(levels[k], f"lengths level {k}"), data.shape[0]
            if total != rows:
                raise LoDError(f"lengths level {k} ({_finest(k)}): lengths sum to {total} but "
                               f"the data has {rows} rows")
        return cls(data, [offsets_from_lengths(lens) for lens in levels])

    @classmethod
    def from_padded(cls, padded, lengths):
        """Build a 1-level LoDTensor from ``padded [B, T, ...]`` and ``lengths [B]``.

        The inverse of :meth:`to_padded`.

        Parameters
        ----------
        padded : array_like
            ``[B, T, ...]``: ``B`` sequences of up to ``T`` steps each.
        lengths : sequence of int
            ``[B]``: sequence ``b`` is ``padded[b, :lengths[b]]``; every length
            must lie in ``[0, T]``.

        Returns
        -------
        LoDTensor
            One level, ``B`` sequences; its data is a fresh array
            ``[sum(lengths), ...]``.

        Raises
        ------
        LoDError
            ``padded`` has fewer than 2 dimensions, ``lengths`` does not have
            ``B`` entries, or a length lies outside ``[0, T]``.

        Examples
        --------
        >>> padded = np.array([[1, 2, 0], [3, 0, 0]])
        >>> t = LoDTensor.from_padded(padded, [2, 1])
        >>> t.data.tolist(), t.lod
        ([1, 2, 3], [[0, 2, 3]])
        """
        padded = _rows_array(padded, "padded")
        if padded.ndim < 2:
            raise LoDError(f"padded must have shape [B, T, ...] (got shape {padded.shape})")
        lens = _int_array(lengths, "lengths", "index", "lengths")
        batch, steps = padded.shape[:2]
        if lens.size != batch:
            raise LoDError(f"lengths has {lens.size} entries but padded has {batch} "
                           f"sequences (shape {padded.shape})")
        bad = np.flatnonzero((lens < 0) | (lens > steps))
        if bad.size:
            i = int(bad[0])
            raise LoDError(f"lengths, index {i}: length {int(lens[i])} is out of "
                           f"range [0, {steps}]")
        mask = np.arange(steps) < lens[:, None]
        return cls(padded[mask], [offsets_from_lengths(lens)])

    @classmethod
    def concat(cls, tensors):
        """Join LoDTensors: the top-level sequences of each, in order.

        Parameters
        ----------
        tensors : iterable of LoDTensor
            At least one; all with the same number of levels (at least 1),
            the same feature shape ``data.shape[1:]`` and the same dtype.

        Returns
        -------
        LoDTensor
            The sequences of ``tensors[0]``, then those of ``tensors[1]``, and
            so on; its data is a fresh array.

        Raises
        ------
        LoDError
            ``tensors`` is empty, or the tensors differ in number of levels,
            feature shape or dtype (or have no levels).
        TypeError
            An element is not a LoDTensor.

        Examples
        --------
        >>> a = LoDTensor.from_lengths(np.arange(3), [[1, 2]])
        >>> b = LoDTensor.from_lengths(np.arange(2), [[2]])
        >>> LoDTensor.concat([a, b]).lod
        [[0, 1, 3, 5]]
        """
        tensors = list(tensors)
        if not tensors:
            raise LoDError("concat needs at least one LoDTensor")
        for j, t in enumerate(tensors):
            if not isinstance(t, LoDTensor):
                raise TypeError(f"concat: tensors[{j}] is a {type(t).__name__}, "
                                f"not a LoDTensor")
        first = tensors[0]
        first._require_levels("concat")
        for j, t in enumerate(tensors[1:], start=1):
            if t.num_levels != first.num_levels:
                raise LoDError(f"concat: tensors[{j}] has {t.num_levels} lod levels, "
                               f"tensors[0] has {first.num_levels}")
            if t.shape[1:] != first.shape[1:]:
                raise LoDError(f"concat: tensors[{j}] has feature shape {t.shape[1:]}, "
                               f"tensors[0] has {first.shape[1:]}")
            if t.dtype != first.dtype:
                raise LoDError(f"concat: tensors[{j}] has dtype {t.dtype}, "
                               f"tensors[0] has {first.dtype}")
        levels = [
            offsets_from_lengths(np.concatenate([np.diff(t.levels[k]) for t in tensors]))
            for k in range(first.num_levels)
        ]
        check_large("LoDTensor.concat: the joined rows", (sum(t.shape[0] for t in tensors),)
                    + first.shape[1:], first.dtype)  # (broadcast rows are copied whole)
        data = np.concatenate([t._rows("concat") for t in tensors], axis=0)
        return cls(data, levels)

    # -- properties --------------------------------------------------------

    @property
    def data(self):
        """The data array ``[N, ...]`` (not a copy)."""
        return self._data

    @property
    def levels(self):
        """The offset levels: a tuple of read-only int64 arrays, coarsest first."""
        return self._levels

    @property
    def lod(self):
        """The offset levels as a fresh list of lists of Python ints."""
        return [offsets.tolist() for offsets in self._levels]

    @property
    def lengths(self):
        """Per-level lengths (Paddle's recursive sequence lengths), as lists."""
        return [np.diff(offsets).tolist() for offsets in self._levels]

    @property
    def num_levels(self):
        """Number of LoD levels (0 for a plain array of rows)."""
        return len(self._levels)

    @property
    def num_sequences(self):
        """Number of top-level sequences (``len(lod[0]) - 1``)."""
        self._require_levels("num_sequences")
        return len(self._levels[0]) - 1

    @property
    def shape(self):
        """``data.shape``."""
        return self._data.shape

    @property
    def dtype(self):
        """``data.dtype``."""
        return self._data.dtype

    def __len__(self):
        """Number of top-level sequences (not data rows; see ``shape[0]``)."""
        return self.num_sequences

    @property
    def on_device(self):
        """Whether the data lies on a GPU (a ``numba.cuda`` device array)."""
        return not isinstance(self._data, np.ndarray)

    def to_host(self):
        """This tensor with its data on the host: itself where it is there
        already, else a copy of the rows (the LoD shared)."""
        return self if not self.on_device else LoDTensor._trusted(self._data.copy_to_host(),
                                                                  self._levels)

    def to_device(self):
        """This tensor with its data on the GPU (a ``numba.cuda`` device
        array, C-contiguous): itself where it is there already, else a copy of
        the rows (the LoD shared)."""
        if self.on_device:
            return self
        from numba import cuda

        return LoDTensor._trusted(cuda.to_device(np.ascontiguousarray(self._data)), self._levels)

    def _rows(self, what):
        """The data for an operation that computes on the rows: on the host."""
        if self.on_device:
            raise LoDError(f"{what}: this LoDTensor's data is on the GPU; call .to_host() first")
        return self._data

    def __repr__(self):
        levels = ", ".join(_format_level(offsets) for offsets in self._levels)
        return f"LoDTensor(shape={self.shape}, dtype={self.dtype}, lod=[{levels}])"

    # -- operations --------------------------------------------------------

    def _require_levels(self, what):
        if not self._levels:
            raise LoDError(f"{what}: this LoDTensor has no LoD levels")

    def astype(self, dtype):
        """A copy with data cast to ``dtype`` and the same LoD.

        Parameters
        ----------
        dtype : data-type
            Anything ``np.ndarray.astype`` takes, e.g. ``np.float32``.

        Returns
        -------
        LoDTensor
            A new tensor with the same LoD, whose data is a cast copy (a copy
            even when the dtype already is ``dtype``).

        Raises
        ------
        SizeError
            The copy would not fit (data broadcast over many rows is made
            whole by it).
        """
        rows = self._rows("astype")
        check_large("LoDTensor.astype: the cast copy", rows.shape, dtype)
        return LoDTensor(rows.astype(dtype), self._levels)

    def to_padded(self, pad_value=0, steps=None):
        """Pad the sequences of the last level into ``[B, T, ...]``.

        The inverse of :meth:`from_padded` for a 1-level tensor; with more
        levels, the coarser ones are dropped.

        Parameters
        ----------
        pad_value : scalar, default 0
            What positions past a sequence's end hold.
        steps : int, optional
            ``T``, the padded length; at least the longest sequence. None: the
            longest sequence (0 if there are none).

        Returns
        -------
        padded : ndarray
            ``[B, T, ...]`` with the tensor's dtype; ``B`` is the number of
            sequences of the last level.
        lengths : ndarray
            ``[B]`` int64, each sequence's length.

        Raises
        ------
        LoDError
            The tensor has no levels, or ``steps`` is shorter than the longest
            sequence.

        Examples
        --------
        >>> t = LoDTensor(np.array([1, 2, 3]), [[0, 2, 3]])
        >>> padded, lengths = t.to_padded(pad_value=-1)
        >>> padded.tolist(), lengths.tolist()
        ([[1, 2], [3, -1]], [2, 1])
        """
        self._require_levels("to_padded")
        data = self._rows("to_padded")
        offsets = self._levels[-1]
        lens = np.diff(offsets)
        batch = lens.size
        longest = int(lens.max()) if batch else 0
        if steps is None:
            steps = longest
        elif isinstance(steps, (bool, np.bool_)) or not isinstance(steps, (int, np.integer)):
            raise LoDError(f"to_padded: steps must be an integer, got {steps!r}")
        elif steps < longest:
            raise LoDError(f"to_padded: steps={steps} is shorter than the longest sequence ({longest})")
        check_large("LoDTensor.to_padded: the padded array", (batch, steps) + self.shape[1:], self.dtype)
        padded = np.full((batch, steps) + self.shape[1:], pad_value, dtype=self.dtype)
        rows = self.shape[0]
        seq = np.repeat(np.arange(batch), lens)
        pos = np.arange(rows) - np.repeat(offsets[:-1], lens)
        padded[seq, pos] = data
        return padded, lens

    def sequence(self, i):
        """Top-level sequence ``i``.

        Parameters
        ----------
        i : int
            Its index; negative counts from the end.

        Returns
        -------
        ndarray or LoDTensor
            With one level: an ndarray, a view of the sequence's data rows.
            With ``k > 1`` levels: a ``(k - 1)``-level LoDTensor whose offsets
            start at 0 (its data is a view).

        Raises
        ------
        IndexError
            ``i`` is out of range.
        LoDError
            The tensor has no levels.

        Examples
        --------
        >>> t = LoDTensor(np.arange(5), [[0, 2, 5]])
        >>> t.sequence(-1).tolist()
        [2, 3, 4]
        """
        n = self.num_sequences
        index = operator.index(i)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sequence index {i} is out of range for {n} sequences")
        start, stop = index, index + 1
        sub_levels = []
        for k, offsets in enumerate(self._levels):
            if k > 0:
                sub_levels.append(offsets[start:stop + 1] - offsets[start])
            start, stop = int(offsets[start]), int(offsets[stop])
        rows = self._rows("sequence")[start:stop]
        if not sub_levels:
            return rows
        return LoDTensor(rows, sub_levels)

    def select(self, indices):
        """A new LoDTensor of the given top-level sequences, in the given order.

        Used to reorder a batch (e.g. by decreasing length) or to take a part
        of it.

        Parameters
        ----------
        indices : sequence of int
            1-D; top-level sequence indices, which may repeat and may be
            negative (counting from the end).

        Returns
        -------
        LoDTensor
            Every level kept; its data is a copy.

        Raises
        ------
        TypeError
            ``indices`` is not a 1-D sequence of integers.
        IndexError
            An index is out of range.
        LoDError
            The tensor has no levels.

        Examples
        --------
        >>> t = LoDTensor(np.arange(5), [[0, 2, 5]])
        >>> s = t.select([1, 0])
        >>> s.data.tolist(), s.lod
        ([2, 3, 4, 0, 1], [[0, 3, 5]])
        """
        n = self.num_sequences
        idx = np.asarray(indices)
        if idx.ndim != 1 or not (idx.size == 0 or idx.dtype.kind in "iu"):
            raise TypeError(f"select: indices must be a 1-D sequence of integers "
                            f"(got dtype {idx.dtype}, shape {idx.shape})")
        if _has_bool(indices):
            raise TypeError("select: indices must be integers, not bools")
        given, idx = idx, idx.astype(np.int64)
        wrapped = given > _INT64_MAX if given.dtype.kind == "u" else False  # (uint64 past int64)
        bad = np.flatnonzero((idx < -n) | (idx >= n) | wrapped)
        if bad.size:
            j = int(bad[0])
            raise IndexError(f"select: indices[{j}] = {int(given[j])} is out of range "
                             f"for {n} sequences")
        idx = np.where(idx < 0, idx + n, idx)
        levels = []
        for offsets in self._levels:
            starts, stops = offsets[idx], offsets[idx + 1]
            levels.append(offsets_from_lengths(stops - starts))
            if offsets is self._levels[-1]:  # (the rows copied: broadcast ones whole)
                check_large("LoDTensor.select: the selected rows", (int(levels[-1][-1]),)
                            + self.shape[1:], self.dtype)
            idx = _concat_ranges(starts, stops)
        return LoDTensor(self._rows("select")[idx], levels)
