"""A net's input products by chunks of steps, each chunk's computed a chunk
ahead on the helper thread (``threads``).

Where a run stays on one thread and the helper is free (one sequence: W3),
the rnn function's call at a chunk's first step posts the next chunk's
product (``blas.gemm_steps``) to the helper and returns; the helper
computes it while the rnn function runs the chunk's steps, into buffers of
the rnn function's own that the two swap at the next chunk. The helper
computes what the calling thread would, so the result is the same bits.

``gemm_steps_ahead`` is compiled once and called apart by the generated
kernels (``apart``); it calls ``gemm_steps`` apart too, so its code holds
its own lines only (a new kernel compiles nothing of it, and an empty
cache compiles it in a fraction of a second).
"""

from __future__ import annotations

from numba import njit

from . import apart, blas, threads
from .atomics import JOB_WORDS

# the int64 words of ``gemm_steps_ahead``'s state: whether a job is posted,
# the job (``atomics.job_of``'s pair), its record (``apart.job_apart_in``)
AHEAD_WORDS = 3 + JOB_WORDS


@njit(cache=True)
def _gemm_steps_ahead(left, col, sstart, slen, row_step, step, chunk, nb, reverse, gathered,
                      prepared, out, gathered_ahead, out_ahead, state, posts):
    """``gemm_steps`` at a chunk's first step, a chunk ahead: the chunk's
    product into ``out`` (computed here; or, where the last chunk posted it,
    by the helper into ``out_ahead``, its job finished or taken back first:
    ``threads.finish_job``), then the next chunk's posted to the helper
    (``threads.post_job``) while the caller runs this chunk's steps.
    Returns whether the caller swaps ``out`` and ``out_ahead`` (and
    ``gathered`` and ``gathered_ahead``): the chunk's product is in
    ``out_ahead``. ``state``: ``AHEAD_WORDS`` int64 the caller keeps, zeros
    at first, with the buffers, until its last chunk: a posted job writes
    into them until it is done (so nothing else may raise in between).
    ``posts``: whether the next chunk goes to the helper at all (not where
    the kernel's per-step products share with it)."""
    board = prepared[3]
    swap = state[0] != 0
    if swap:
        if threads.finish_job(board, (state[1], state[2])) == threads.RAISED:  # (raise here)
            apart.call_apart(blas.gemm_steps, (left, col, sstart, slen, row_step, step, chunk,
                                               nb, reverse, gathered_ahead, prepared, out_ahead))
    else:
        apart.call_apart(blas.gemm_steps, (left, col, sstart, slen, row_step, step, chunk, nb,
                                           reverse, gathered, prepared, out))
    state[0] = 0
    if posts and step + chunk < slen[0] and board[threads.SHARES] & threads.AHEAD != 0:
        # into the buffers that are the caller's ahead ones after its swap, over the
        # sequences running then (the caller's rows: a library's differ by those beside)
        next_gathered = gathered if swap else gathered_ahead
        next_out = out if swap else out_ahead
        then = nb
        while then > 0 and slen[then - 1] <= step + chunk:
            then -= 1
        job = apart.job_apart_in(state[3:], blas.gemm_steps,
                                 (left, col, sstart, slen, row_step, step + chunk, chunk, then,
                                  reverse, next_gathered, prepared, next_out))
        state[1], state[2] = job[0], job[1]
        state[0] = threads.post_job(board, job)
    return swap


# what the generated kernels call (apart)
gemm_steps_ahead = apart.called_apart(_gemm_steps_ahead)
