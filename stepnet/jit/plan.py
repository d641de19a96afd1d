"""The parallel plan of one call of a kernel of the Numba backend, decided
here and nowhere else before the kernel runs; ``compiled.explain(**inputs)``
prints it.

A call's top-level sequences run either as groups on Python threads
(contiguous ranges balanced by data rows, one kernel call each, every call
releasing the GIL, none sharing with the helper), or as one group on the
calling thread. One group may share its work with the helper thread
(``threads``): part of its sequences where the kernel cuts them
(``threads.group_cut``), else part of each step's products where the
small-product table shares products of their size (``blas``). Where the
work is cut follows from the plan and the shapes only; who computes the
second part (the helper may be busy) changes no bit of the result.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from . import blas, threads


class RunPlan(NamedTuple):
    """What a call runs where (a named tuple: a call makes one, cheaply)."""
    threads: int  # the threads the call may use (Numba's count; None: not needed to decide)
    sequences: int  # top-level sequences of the call
    rows: int  # their data rows (of the finest level)
    groups: tuple  # ((first, end), ...): the top-level sequences of each group, in order
    helper: bool  # one group, and it may share its work with the helper thread
    cuts_sequences: bool  # the kernel cuts the sequences of each net with the helper
    reason: str  # why the groups are what they are

    def check(self) -> RunPlan:
        """The plan, or ``AssertionError`` where it is not one a kernel can
        run: groups that do not cover the sequences in order, more groups
        than threads, a helper beside groups on threads."""
        ends = [0] + [end for _, end in self.groups]
        assert self.groups and self.groups[0][0] == 0 and ends[-1] == self.sequences, self
        assert all(first == end for (first, _), end in zip(self.groups, ends)), self
        assert all(first < end for first, end in self.groups) or self.sequences == 0, self
        assert len(self.groups) <= max(1, self.threads or 1), self
        assert not (self.helper and len(self.groups) > 1), self
        return self

    def __str__(self):
        lines = [f"{self.sequences} sequences, {self.rows} rows, {self.threads or 'any'} threads: "
                 f"{len(self.groups)} group{'s' if len(self.groups) != 1 else ''} ({self.reason})"]
        if len(self.groups) > 1:
            lines += [f"  thread {i}: sequences {a}:{b}" for i, (a, b) in enumerate(self.groups)]
        elif not self.helper:
            lines.append("  helper: none (too little work to share, or no second thread)")
        elif self.cuts_sequences:
            lines.append("  helper: takes part of each net's sequences where it is free "
                         "(group_cut), else part of the step's products the small-product "
                         "table shares")
        else:
            lines.append("  helper: takes part of the step's products the small-product table "
                         "shares, where it is free")
        return "\n".join(lines)


def _one_group(kernel, rows, width, sequences, count):
    """``(count, why)``: why such a run is one group, or None where it is groups
    on Python threads (work per row: the widest of ``width``, ``kernel.work_width``).
    Not where the kernel cuts its sequences with the helper, the one other
    thread: its handover costs under a microsecond, a Python thread's hundreds."""
    if sequences < 2:
        return count, "one sequence"
    if rows * max(width, kernel.work_width) < threads.SPLIT_MIN_WORK:
        return count, "too little work for Python's threads"
    count = count or threads.count()
    if count < 2:
        return count, "one thread"
    if count == 2 and kernel.cuts_sequences and threads.SPINS and threads.BOARD[threads.SHARES] & threads.CUT:
        return count, "the kernel cuts its sequences with the helper"
    return count, None


def splits(kernel, rows, width, sequences, count=None) -> bool:
    """Whether such a run is groups on Python threads (:func:`_one_group`)."""
    return _one_group(kernel, rows, width, sequences, count)[1] is None


def shares(kernel, rows, sequences, count=None) -> bool:
    """Whether a run of one group may share its work with the helper: where
    there is a second thread (and spinning), the board shares something
    (``threads.SHARES``), and either the kernel's largest weights are worth
    sharing a product of, or its sequences are worth cutting (``GROUP_WORK``)."""
    worth = kernel.largest_weights >= blas.SHARE_OWN_WORK or (
        sequences >= 2 and rows * kernel.largest_weights >= threads.GROUP_WORK)
    return worth and threads.SPINS and threads.BOARD[threads.SHARES] != 0 and (count or threads.count()) >= 2


def plan(kernel, sequence, count=None) -> RunPlan:
    """The plan of a call of ``kernel`` whose first sequence input is the
    LoDTensor ``sequence``, on ``count`` threads (None: Numba's count)."""
    n, rows = sequence.num_sequences, sequence.data.shape[0]
    count, why = _one_group(kernel, rows, math.prod(sequence.data.shape[1:]) or 1, n, count)
    if why is not None:
        return RunPlan(count, n, rows, ((0, n),), shares(kernel, rows, n, count),
                       kernel.cuts_sequences, why)
    starts = np.asarray(sequence.levels[0], np.int64)  # data rows before each sequence
    for level in sequence.levels[1:]:
        starts = np.asarray(level, np.int64)[starts]
    groups = min(count, n)
    cuts = np.searchsorted(starts, [rows * g / groups for g in range(1, groups)])
    bounds = [0] + sorted({int(min(max(c, 1), n - 1)) for c in cuts}) + [n]
    ranges = tuple((a, b) for a, b in itertools.pairwise(bounds) if b > a)
    return RunPlan(count, n, rows, ranges, False, kernel.cuts_sequences,
                   "groups balanced by rows on Python threads").check()
