"""The threads stepnet runs compiled work on: a small pool of Python threads
calling ``nogil`` kernels, each kernel single-threaded (its BLAS calls too).

Nothing here uses Numba's parallel layer or a BLAS library's own thread pool,
so no step waits on a barrier and no idle pool spins beside the kernels. The
thread count is Numba's (``numba.set_num_threads``, ``NUMBA_NUM_THREADS``).
"""

from __future__ import annotations

import concurrent.futures

import numba

_POOL = None


def count() -> int:
    """How many threads a call may use."""
    return numba.get_num_threads()


def _pool(workers):
    global _POOL
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                      thread_name_prefix="stepnet")
    return _POOL


def run_each(fn, items):
    """``[fn(item) for item in items]``, the first on the calling thread and
    the others at the same time on the pool (``fn`` must release the GIL for
    its heavy part)."""
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    futures = [_pool(len(items) - 1).submit(fn, item) for item in items[1:]]
    return [fn(items[0])] + [f.result() for f in futures]
