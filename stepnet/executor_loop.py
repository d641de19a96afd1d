"""The schedule executor's compiled loop (:mod:`stepnet.executor`): one
function per dtype, ``steps_loop``, compiled once per install, machine and
BLAS into ``STEPNET_CACHE_DIR`` (by the compile worker where tiered), which
runs a group's time loop as a program of instructions over a table of
addresses: elementwise runs as a bytecode of the ops in ``LOOP_OPS``, each
op's code the kernels', and products as the kernels' per-step products."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from . import registry

# the ops an elementwise run's loop computes (their float results): opcode
# 2 + index (0 loads an operand's row, 1 stores one)
LOOP_OPS = ("add", "sub", "mul", "div", "maximum", "minimum", "neg", "abs", "exp", "log", "sqrt",
            "tanh", "sigmoid", "softplus", "erf", "relu")
# values a register of the loop holds at most: a run computes each op over a
# tile of whole rows at a time, not a row at a time
REGISTER_VALUES = 1024
# the bytes of a run's registers together, which bounds a tile's rows: half
# of a first-level data cache of 32 KiB (the smallest of the x86-64 CPUs),
# the rest for the operands' rows (registers of 1,024 values each outgrew
# it on W1's gates, whose ops then ran from the second-level cache)
REGISTER_BYTES = 16 << 10
# the table's last column where a value's rows are not by its strides: at
# the caller's row of each token (the executor's layout.perm), or in a
# buffer of two chunks' rows, from the chunk's first token in the half of the
# chunk's parity (a hoisted stage's)
BY_CALLER, BY_CHUNK = -1, -2


def registers_of(count, width, dtype):
    """The loop's ``count`` registers for runs of rows of at most ``width``
    values: each holds whole rows, as many as ``REGISTER_BYTES`` holds over
    the ``count`` registers (``REGISTER_VALUES`` values at most), one at least."""
    width = max(width, 1)  # (rows of no values: registers of one value)
    values = min(REGISTER_VALUES, REGISTER_BYTES // (count * np.dtype(dtype).itemsize))
    return np.empty((count, max(1, values // width) * width), dtype)


_LOOPS = {}  # dtype -> the loop, once it is compiled here
_REFUSED = set()  # the dtypes whose loop the compile worker failed to compile
_LOOPS_LOCK = threading.Lock()


def loop(dtype):
    """The executor's loop for ``dtype`` where it is compiled in this
    process or in the disk cache (loaded), else None: then the compile
    worker compiles it (once per install, machine and BLAS; without a
    worker, here)."""
    loop = _LOOPS.get(dtype)
    if loop is not None:
        return None if loop is _PENDING else loop
    from .jit import blas, loading  # noqa: F401 (its products call the chosen BLAS: in the key)

    with _LOOPS_LOCK:
        if dtype in _LOOPS:  # (made meanwhile by another thread)
            return None if _LOOPS[dtype] is _PENDING else _LOOPS[dtype]
        source = _loop_source(dtype)
        module, key, signature = loading.load_source(source), loading.kernel_key(source), \
            _signature(dtype)
        if loading.ready_marker(key).exists() or not loading.tiered() or dtype in _REFUSED:
            loading.link_helpers(module)  # (its own product loop's C entry)
            module.steps_loop.compile(signature)  # (loaded from the disk cache where it is there)
            loading.mark_ready(key)
            _LOOPS[dtype] = module.steps_loop
            return module.steps_loop
        _LOOPS[dtype] = _PENDING

    def answered(error):  # (the next call loads it; where the worker failed, compiles it here)
        with _LOOPS_LOCK:
            _LOOPS.pop(dtype, None)
            if error is not None:
                _REFUSED.add(dtype)

    try:
        loading.compile_worker().submit(SimpleNamespace(key=key, module=module), signature,
                                        answered, function="steps_loop")
    except OSError:
        answered("no compile worker")
    return None


_PENDING = object()
_ENTRIES = {}  # dtype -> the loop's entry point (a call with no dispatch: entry_point)


def entry_point(dtype):
    """The entry point of :func:`loop`'s loop for ``dtype`` (called with
    no dispatch on its arguments' types), or None while it is not there."""
    found = _ENTRIES.get(dtype)
    if found is None and loop(dtype) is not None:
        found = _ENTRIES[dtype] = _LOOPS[dtype].overloads[_signature(dtype)].entry_point
    return found


def _signature(dtype):
    from numba import from_dtype, types

    values = from_dtype(dtype)
    return (types.int64[:, ::1], types.int64[:, ::1], types.int64[:, ::1], types.int64[::1],
            types.int64[::1], types.Array(values, 2, "C"), types.Array(values, 1, "C"),
            types.int64[::1], types.int64[:, ::1], types.int64[::1])


def _loop_source(dtype):
    """The module of ``steps_loop(prog, code, table, active, starts, registers,
    scratch, board, small_rows, perm)``: at each step ``t`` (``active[t]`` rows
    from the token ``starts[t]``) the instructions of ``prog``, each a row
    ``(kind, a, b, c, d, e, chunk, rows, q, ahead)``: kind 0 a run of the
    bytecode ``code[a:b]`` (:class:`executor_program.Run`) over rows of ``c``
    values, a tile of rows at a time (as many as a register,
    ``registers.shape[1]`` values, holds: each op one loop over the tile);
    kind 1 the ``q``-th product, of at most ``rows`` rows of the table's row
    ``a`` (the left operand, ``d`` columns) by ``b`` (the weights, ``e``
    columns) into ``c``, as the kernels' per-step products (``blas.pack``
    once a call, ``blas.gemm_packed`` on ``board`` and the measured
    ``small_rows``: the own loop or the chosen BLAS); with a ``chunk``, a
    hoisted stage's, every ``chunk``-th step over the rows of the steps to
    the next (packed for that many rows, as the kernels' chunks), into the
    half of its buffers of ``rows`` rows each that the chunk's parity
    picks; with ``ahead``, the next chunk's product then posted to the
    helper, which computes it into the other half while this thread runs
    the chunk's steps (``ahead.gemm_steps_ahead``'s way: a lone group's
    input products take no time of its time loop); in float32 loops, kind 2
    the ``q``-th int8 product (``matmul_int8``: ``quantized.int8_rows``, the
    kernels' routine) likewise, kind 3 the ``q``-th bf16 one (``bf16_rows``),
    their weights prepared by the caller (``_quantized_source``).
    ``table`` holds each operand's and result's address, row stride, whether a
    row holds ``width`` values (else one, broadcast), and the stride by which a
    step's first token moves its first row (``BY_CALLER``: rows at the
    caller's, ``perm[token]``; ``BY_CHUNK``: rows of a buffer of the chunk's
    rows); ``scratch`` holds a left operand whose rows are apart. A run
    reads an operand where it is when the tile's rows follow one another (or
    are one row: ``where`` holds each register's address, its own or an
    operand's), and loads one whose rows neither move nor differ (a bias) at
    a step's first tile only."""
    dt = f"np.{np.dtype(dtype).name}"
    quantized = np.dtype(dtype) == np.float32  # (matmul_int8's, matmul_bf16's: float32 rows)
    weights, at_step = _quantized_source() if quantized else ([], [])
    before, at_chunk = _ahead_source()
    lines = ["def steps_loop(prog, code, table, active, starts, registers, scratch, board,",
             "               small_rows, perm):",
             "    wide_vectors()",
             "    prog, table, perm = unowned(prog), unowned(table), unowned(perm)",
             "    scratch, registers = unowned(scratch), unowned(registers)",
             "    steps = active.shape[0]",
             "    tokens = starts[steps - 1] + active[steps - 1] if steps > 0 else 0",
             f"    prepared = [pack(carray(pointer_to(table[prog[p, 2], 0], {dt}), "
             "(prog[p, 4], prog[p, 5])),",
             "                     prog[p, 7], tokens, small_rows, board)",
             "                for p in range(prog.shape[0]) if prog[p, 0] == 1]",
             *weights,
             "    ring = 0  # (the first token of the last chunk, less its half's rows)",
             "    where = np.empty(registers.shape[0], np.int64)  # (where each register's rows are)",
             *before,
             "    for t in range(steps):",
             "        for p in range(prog.shape[0]):",
             "            chunk, rows, lo = prog[p, 6], active[t], starts[t]",
             "            if chunk > 0:  # (a hoisted stage: every chunk steps, their rows,",
             "                if t % chunk != 0:  # in the buffers' half of the chunk)",
             "                    continue",
             "                end = min(t + chunk, steps) - 1",
             "                rows, ring = starts[end] + active[end] - lo, lo - t // chunk % 2 * prog[p, 7]",
             *at_chunk,
             "            if prog[p, 0] == 1:",
             "                product(prog[p], table, rows, lo, scratch, prepared[prog[p, 8]], perm, ring,",
             "                        True)",
             "                continue",
             *at_step,
             *_run_source(dtype)]
    from .jit.cpu_emit import loop_module

    return loop_module(lines + _product_source(dt),
                       imports=[*(["from stepnet.jit.quantized import bf16_rows, int8_rows"]
                                  if quantized else []),
                                "from stepnet.jit.ahead import AHEAD_WORDS",
                                "from stepnet.jit.apart import job_apart_in",
                                "from stepnet.jit.blas import gemm_own, gemm_packed, pack",
                                "from stepnet.jit.threads import (AHEAD, COLUMNS, RAISED, SHARES, "
                                "finish_job,", "    post_job)",
                                f"BY_CALLER, BY_CHUNK = {BY_CALLER}, {BY_CHUNK}",
                                f"SMALL_GEMM_DTYPES = ({np.dtype(dtype).name!r},)"])


def _quantized_source():
    """The lines of ``steps_loop`` viewing each quantized product's weights
    as its routine (``quantized.int8_rows``, ``bf16_rows``) reads them, and
    its instruction at a step. The weights' table row holds their address
    and shape (an int8 product's packed weights, then a row of its scales'
    address; a bf16 product's packed pairs where the CPU multiplies
    bfloat16, else its weights widened to float32, [k, n])."""
    from .jit.int8_gemm import _PACKED, BF16

    def view(dtype, dims):
        shape = ", ".join(f"table[prog[p, 2], {d}]" for d in range(1, dims + 1))
        return f"carray(pointer_to(table[prog[p, 2], 0], np.{np.dtype(dtype).name}), ({shape}))"

    return [f"    int8_weights = [({view(_PACKED, 3)},",
            "                     carray(pointer_to(table[prog[p, 2] + 1, 0], np.float32), prog[p, 5]))",
            "                    for p in range(prog.shape[0]) if prog[p, 0] == 2]",
            f"    bf16_weights = [{view(np.uint16, 3) if BF16 else view(np.float32, 2)}",
            "                    for p in range(prog.shape[0]) if prog[p, 0] == 3]"], [
        "            if prog[p, 0] >= 2:  # (an int8 or a bf16 product)",
        "                if rows > 0:",
        "                    a, out = operands(prog[p], table, rows, lo, scratch, perm, ring, False)",
        "                    if prog[p, 0] == 2:",
        "                        int8_rows(a, int8_weights[prog[p, 8]], out)",
        "                    else:",
        "                        bf16_rows(a, bf16_weights[prog[p, 8]], out)",
        "                continue"]


def _ahead_source():
    """The lines of ``steps_loop`` computing a chunk's product a chunk ahead
    on the helper: before its time loop (the job's state, and whether it is
    posted at all: not where a per-step product shares with the helper, as
    the kernels' ``ahead_posts``), and its instruction at a chunk's first
    step (the chunk's product finished, or computed here where it was not
    posted or raised; then the next chunk's posted)."""
    before = ["    ahead = np.zeros(AHEAD_WORDS, np.int64)",
              "    posts = board[SHARES] & AHEAD != 0",
              "    for p in range(prog.shape[0]):",
              "        if prog[p, 0] == 1 and prog[p, 6] == 0 and \\",
              "                prepared[prog[p, 8]][5][SHARES] & COLUMNS != 0:",
              "            posts = False"]
    at_chunk = [
        "            if prog[p, 0] == 1 and prog[p, 9] == 1:",
        "                if ahead[0] == 0 or finish_job(board, (ahead[1], ahead[2])) == RAISED:",
        "                    product(prog[p], table, rows, lo, scratch, prepared[prog[p, 8]], perm,",
        "                            ring, False)  # (not posted, or raised: here)",
        "                ahead[0] = 0",
        "                if posts and t + chunk < steps:  # (the next chunk's, on the helper)",
        "                    t1 = t + chunk",
        "                    end = min(t1 + chunk, steps) - 1",
        "                    lo1 = starts[t1]",
        "                    rows1 = starts[end] + active[end] - lo1",
        "                    ring1 = lo1 - t1 // chunk % 2 * prog[p, 7]",
        "                    a, out = operands(prog[p], table, rows1, lo1, scratch, perm, ring1, True)",
        "                    job = job_apart_in(ahead[3:], gemm_packed, (a, prepared[prog[p, 8]], out))",
        "                    ahead[1], ahead[2] = job[0], job[1]",
        "                    ahead[0] = post_job(board, job)",
        "                continue"]
    return before, at_chunk


def _run_source(dtype):
    """The lines of ``steps_loop`` running a run's bytecode, a tile of rows
    at a time: each operand's rows loaded (or read where they are), each op
    of ``LOOP_OPS`` one loop over the tile (its code the kernels'), each
    value read after the run stored."""
    from .jit.cpu_emit import op_code

    lines = ["            width = prog[p, 3]",
             "            tile = max(1, registers.shape[1] // width)  # rows a register holds",
             "            for i0 in range(0, rows, tile):",
             "                n = min(tile, rows - i0)",
             "                for c in range(prog[p, 1], prog[p, 2]):",
             "                    op, k = code[c, 0], code[c, 1]",
             "                    r = registers[k]",
             "                    if op == 0:  # an operand's rows",
             "                        x = code[c, 2]",
             "                        if i0 == 0 or table[x, 1] != 0 or table[x, 3] != 0:",
             "                            where[k] = load(r, table, x, lo, i0, n, width, perm, ring)",
             "                        # (else the same rows as the first tile's: still there)",
             "                        continue",
             "                    if op == 1:  # a value's rows stored",
             "                        store(view(where, k, r), table, code[c, 2], lo, i0, n, width, perm,",
             "                              ring)",
             "                        continue",
             "                    where[k] = r.ctypes.data  # (a value an op computes: its own)"]
    for k, name in enumerate(LOOP_OPS):
        inputs = registry.get(name).num_inputs
        lines += [f"                    {'elif' if k else 'if'} op == {2 + k}:  # {name}",
                  "                        a = view(where, code[c, 2], r)"]
        if inputs > 1:
            lines.append("                        b = view(where, code[c, 3], r)")
        lines += ["                        for j in range(n * width):",
                  f"                            r[j] = {op_code(name, ['a[j]', 'b[j]'][:inputs], dtype)}"]
    return lines


def _product_source(dt):
    """The lines of ``product``: a step's rows of a left operand (copied
    together first where they are apart) by weights prepared by ``pack``;
    then ``view`` (a register's rows where they are), ``unowned`` and the rows' helpers."""
    return ["",
            "",
            "@njit(cache=True, error_model='numpy', nogil=True)",
            "def product(p, table, rows, lo, scratch, prepared, perm, ring, own):",
            "    if rows == 0:",
            "        return",
            "    a, out = operands(p, table, rows, lo, scratch, perm, ring, False)",
            "    # (the own loop called directly where it takes the rows, as the kernels'",
            "    # per-step products: through gemm_packed, a one-row product's call costs",
            "    # more; a chunk's product computed ahead, always through gemm_packed:",
            "    # the helper's bits)",
            "    if not (own and gemm_own(a, prepared[4], prepared[2], prepared[5], out)):",
            "        gemm_packed(a, prepared, out)",
            "",
            "",
            "@njit(cache=True, error_model='numpy', nogil=True, inline='always')",
            "def operands(p, table, rows, lo, scratch, perm, ring, ahead):",
            "    # (a product's left rows and its result's: the left ones where they are,",
            "    # else copied together into scratch first, its last p[7] * k values for",
            "    # a chunk's product computed ahead)",
            "    left, k, n = p[1], p[4], p[5]",
            f"    out = carray(pointer_to(address(table, p[3], lo, 0, perm, ring), {dt}), (rows, n))",
            "    if table[left, 3] != BY_CALLER and table[left, 1] == k * scratch.itemsize:",
            f"        a = carray(pointer_to(address(table, left, lo, 0, perm, ring), {dt}), (rows, k))",
            "        return a, out",
            "    rows_of = scratch[scratch.shape[0] - p[7] * k:] if ahead else scratch",
            f"    a = carray(pointer_to(load(rows_of, table, left, lo, 0, rows, k, perm, ring), {dt}),",
            "               (rows, k))  # (one row: where it is)",
            "    return a, out",
            "",
            "",
            "@njit(cache=True, error_model='numpy', nogil=True, inline='always')",
            "def view(where, i, like):",
            "    # (the rows of register i, where they are: its own, or an operand's)",
            "    return carray(pointer_to(where[i], like.dtype), like.shape[0])",
            "",
            "",
            "@njit(cache=True, error_model='numpy', nogil=True, inline='always')",
            "def unowned(x):",
            "    # (x as a view with no reference count, for the arrays the inlined",
            "    # helpers take, or the loop takes a row of: each array passed to one,",
            "    # or each row taken, is counted in and out, an atomic increment and",
            "    # decrement at each op, load or store of a run; x outlives the loop)",
            "    return carray(pointer_to(x.ctypes.data, x.dtype), x.shape)",
            *_rows_source(dt)]


def _rows_source(dt):
    """The lines of the loop's helpers moving rows: ``load`` (into a
    register), ``store`` (from one), ``address``."""
    return ["",
            "",
            "@njit(cache=True, error_model='numpy', nogil=True, inline='always')",
            "def load(r, table, x, lo, i0, n, width, perm, ring):",
            "    # (where rows i0 + i of the step's are read from: where they are, if",
            "    # one after another, else copied into the register r, or one value",
            "    # each, broadcast; the caller's rows apart: a branch in the rows' loop",
            "    # costs more than a row's copy)",
            "    stride, full = table[x, 1], table[x, 2]",
            "    if table[x, 3] == BY_CALLER:",
            "        for i in range(n):",
            "            copy_in(r, i, table[x, 0] + perm[lo + i0 + i] * stride, width, full)",
            "        return np.int64(r.ctypes.data)",
            "    first = address(table, x, lo, i0, perm, ring)",
            "    if full == 1 and (n == 1 or stride == width * r.itemsize):",
            "        return first",
            "    for i in range(n):",
            "        copy_in(r, i, first + i * stride, width, full)",
            "    return np.int64(r.ctypes.data)",
            "",
            "",
            "@njit(cache=True, error_model='numpy', nogil=True, inline='always')",
            "def copy_in(r, i, at, width, full):",
            "    # (the register's row a view of its own: indexed by j alone, the copy",
            "    # is vectorized)",
            f"    row = carray(pointer_to(r.ctypes.data + i * width * r.itemsize, {dt}), width)",
            "    if full == 1:",
            f"        src = carray(pointer_to(at, {dt}), width)",
            "        for j in range(width):",
            "            row[j] = src[j]",
            "    else:",
            f"        value = carray(pointer_to(at, {dt}), 1)[0]",
            "        for j in range(width):",
            "            row[j] = value",
            "",
            "",
            "@njit(cache=True, error_model='numpy', nogil=True, inline='always')",
            "def store(r, table, x, lo, i0, n, width, perm, ring):",
            "    stride = table[x, 1]",
            "    if table[x, 3] == BY_CALLER:",
            "        for i in range(n):",
            "            copy_out(r, i, table[x, 0] + perm[lo + i0 + i] * stride, width)",
            "    else:",
            "        first = address(table, x, lo, i0, perm, ring)",
            "        for i in range(n):",
            "            copy_out(r, i, first + i * stride, width)",
            "",
            "",
            "@njit(cache=True, error_model='numpy', nogil=True, inline='always')",
            "def copy_out(r, i, at, width):",
            f"    row = carray(pointer_to(r.ctypes.data + i * width * r.itemsize, {dt}), width)",
            f"    dst = carray(pointer_to(at, {dt}), width)",
            "    for j in range(width):",
            "        dst[j] = row[j]",
            "",
            "",
            "@njit(cache=True, error_model='numpy', nogil=True, inline='always')",
            "def address(table, x, lo, i, perm, ring):",
            "    # (row i of a step whose first token is lo: by the table's strides; at",
            "    # the caller's row of the token, perm[lo + i], where its last column is",
            "    # BY_CALLER; in the rows of the chunk from token ring, where BY_CHUNK)",
            "    if table[x, 3] == BY_CALLER:",
            "        return table[x, 0] + perm[lo + i] * table[x, 1]",
            "    if table[x, 3] == BY_CHUNK:",
            "        return table[x, 0] + (lo - ring + i) * table[x, 1]",
            "    return table[x, 0] + lo * table[x, 3] + i * table[x, 1]"]
