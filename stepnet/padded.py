"""Padded arrays of a LoD's rows, as the bridges take and give them: a LoD
of ``d`` levels as ``[B, T1, ..., Td, ...]`` with the lengths of each level
padded alike (``[B]``, ``[B, T1]``, ... ``[B, T1, ..., T(d-1)]``), zeros past
each length. Shared by ``stepnet.jax`` and ``stepnet.torch``."""

from __future__ import annotations

import numpy as np


def mask(levels, shape):
    """Where a padded array of ``shape`` ``[B, T1, ..., Td, ...]`` holds rows,
    for the lengths of its ``d`` levels (``levels``): a bool array
    ``[B, T1, ..., Td]``, its rows in the LoD's order."""
    found = np.ones(shape[:1], bool)
    for i, lens in enumerate(levels):
        steps = np.arange(shape[i + 1]).reshape((1,) * (i + 1) + (-1,))
        found = found[..., None] & (steps < np.asarray(lens)[..., None])
    return found


def lod_lengths(levels):
    """The LoD's lengths of each level of a padded array (``mask``): a
    level's entries under its parent's rows, in order (those past a
    parent's count are not read)."""
    return [np.asarray(levels[0])] + [np.asarray(lens)[mask(levels[:i], np.shape(lens))]
                                      for i, lens in enumerate(levels) if i]


def rows_at_steps(step_lengths, steps, rows):
    """Each step's count of rows where every step of a sequence has that
    sequence's ``rows`` (a ragged static input's, such as attention weights
    over a memory): ``[B, T]`` of a padded ``steps`` ``(B, T)``, 0 past each
    sequence's ``step_lengths``."""
    return np.where(mask((step_lengths,), steps), np.asarray(rows)[:, None], 0)


def to_padded(rows, levels, steps):
    """``rows`` (of a LoD whose levels' lengths are ``levels``) padded with
    zeros to ``steps`` (``[B, T1, ..., Td]``)."""
    out = np.zeros(tuple(steps) + rows.shape[1:], rows.dtype)
    out[mask(levels, out.shape)] = rows
    return out
