"""The Numba backend: a step-net's kernel generated (:mod:`stepnet.jit.cpu_codegen`,
from its plan, :mod:`stepnet.jit.kernel_plan`), loaded (:mod:`stepnet.jit.loading`)
and called on the parallel plan of each call (:mod:`stepnet.jit.plan`).

Importing it has glibc's malloc keep freed memory for the next call
(``GLIBC_MALLOC_OPTIONS``; docs/decisions.md says why).
"""

from __future__ import annotations

import ctypes
import os
import sys

import numba
import numpy as np

from .. import ir, sizes
from ..config import config
from ..errors import LoDError
from ..lod import LoDTensor
from . import plan, product_timing, quantized, threads
from .cpu_codegen import generate_source
from .loading import TieredProgram, kernel_key, link_helpers, load_source, mark_ready, ready_marker, tiered

GLIBC_MALLOC_OPTIONS = {-3: 32 << 20, -1: 256 << 20}  # mallopt's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def _keep_freed_memory():
    """glibc's malloc keeps freed blocks for the next call (see above)."""
    if not config.malloc_tuning or "GLIBC_TUNABLES" in os.environ \
            or any(k.startswith("MALLOC_") for k in os.environ):
        return
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):
        return
    for option, value in GLIBC_MALLOC_OPTIONS.items():
        mallopt(option, value)


config.start_engine("malloc_tuning")
_keep_freed_memory()


# ----------------------------------------------------------------------------
# compiling and running


class NumbaProgram:
    """A program compiled by the Numba backend: ``run(args, consts)``."""

    def __init__(self, program: ir.Program):
        self.program = program
        self.source, layout = generate_source(program)
        self.consts = layout.plan.consts  # (its first parameters)
        self.top_inputs = layout.top_inputs
        self.top_outputs = layout.top_outputs
        self.concatenated = layout.concatenated
        self.prepared = layout.prepared
        self._views = {}  # a join's ident -> (its parts, their view): NumbaProgram._joined
        self.schedule = layout.schedule
        self.given = layout.given
        self.same_lod = layout.same_lod
        self.largest_weights = layout.largest_weights
        self.kernel_plan = layout.plan
        body = program.eqn.attrs["body"]
        # program() cuts the sequences of each net it runs (a nested net run
        # before its time loop as well) in two with the helper
        self.cuts_sequences = layout.plan.cuts_sequences
        self.first_sequence = next(i for i, spec in enumerate(self.top_inputs)
                                   if spec[1] is ir.rnn_parts(program.eqn)[0][0])
        # the widest value a step computes: the work per token, for splitting
        self.work_width = max([int(np.prod(v.shape[1:], dtype=np.int64))
                               for v in (*body.step_inputs, *(o for e in body.eqns for o in e.outputs))
                               if v.batched] + [1])
        # (its products take the float64 limits of product_timing.small_rows_table too)
        self.float64 = any(np.dtype(o.dtype) == np.float64 for e in ir.iter_eqns(body) for o in e.outputs)
        if config.debug:
            print(self.source, file=sys.stderr)
        self.key = kernel_key(self.source)
        self.module = load_source(self.source)
        self._marked = False
        self._linked = False

    def __call__(self, args, consts):
        outputs = self.run_prepared(self.prepare(consts), args)
        if not self._marked:
            self._mark_ready()
        return outputs

    # -- compiling ahead of a call (the tiers) ---------------------------------

    @property
    def ready(self) -> bool:
        """Whether program() is compiled (or loaded from the disk cache) in
        this process."""
        return bool(self.module.program.signatures)

    def compiled_before(self) -> bool:
        """Whether a process compiled this kernel into the disk cache (its
        first call here then loads it, in a fraction of a second)."""
        return ready_marker(self.key).exists()

    def _mark_ready(self):
        self._marked = True
        mark_ready(self.key)

    def signature(self, args, consts):
        """program()'s argument types for a call with ``args``."""
        call = (self.prepare(consts, _SMALL_ROWS_TYPE) + [threads.ALONE, ROWS_IN_ORDER]
                + self._call_args(args) + self.output_buffers(args))
        return tuple(numba.typeof(a) for a in call)

    def _link(self):
        if not self._linked:
            link_helpers(self.module)
            self._linked = True

    def compile(self, signature):
        """Compile program() for ``signature`` without running it."""
        self._link()
        self.module.program.compile(signature)
        self._mark_ready()

    def prepare(self, consts, small_rows=None):
        """The constant arguments of the kernel (merged weights joined, the
        small-product rows: ``product_timing.small_rows_table()`` unless given), laid
        out once for any number of :meth:`run_prepared` calls."""
        if small_rows is None:  # (to run here: linked first, so that small_rows_table may
            self._link()  # time a product by this kernel's helpers)
        const_args = [read_only(consts[v]) for v in self.consts]
        const_args += [self._joined(ident, [consts[v] for v in joined])
                       for ident, joined in self.concatenated.items()]
        const_args += [quantized.prepared(op, [[consts[v] for v in parts] for parts in operands])
                       for op, operands in self.prepared.values()]
        const_args.append(product_timing.small_rows_table(float64=self.float64)
                          if small_rows is None else small_rows)
        return const_args

    def _joined(self, ident, parts):
        """The weights ``parts`` joined by columns for the kernel: a copy a
        call, or where the parts are already side by side (:func:`side_by_side`)
        a view of them, kept for the next call with the same arrays."""
        kept = self._views.get(ident)
        if kept is not None and all(a is b for a, b in zip(kept[0], parts)):
            return kept[1]
        view = side_by_side(parts)
        if view is not None and view.flags.c_contiguous:
            self._views[ident] = (parts, view)  # (the parts kept: their ids stay theirs)
            return view
        return read_only(np.concatenate(parts, axis=1))

    def prepared_call(self, consts):
        """This kernel called with ``consts`` laid out once, for a program of
        one sequence input and dense ones (:class:`stepnet.jit.prepared.PreparedCall`),
        or None where the program is not of that form."""
        from .prepared import PreparedCall

        return PreparedCall.of(self, consts)

    def splits(self, rows, width, num_sequences):
        """Whether such a run is groups on Python threads (:func:`plan.splits`)."""
        return plan.splits(self, rows, width, num_sequences)

    def plan(self, args, count=None) -> plan.RunPlan:
        """The parallel plan of a call on ``args`` (:mod:`stepnet.jit.plan`)."""
        return plan.plan(self, args[self.first_sequence], count)

    def run_prepared(self, const_args, args):
        """The outputs for ``args`` (one value per top-level input), with
        ``const_args = prepare(consts)``. Each sequence group writes its rows
        of the outputs program() takes from its caller in place."""
        self._check_same_lod(args)
        self._link()
        run_plan = self.plan(args)
        groups = run_plan.groups
        buffers = self.output_buffers(args)
        if len(groups) <= 1:
            board = threads.board_for_one_group() if run_plan.helper else threads.ALONE
            return self._run(const_args, board, args, buffers)
        parts = [[self._slice(spec, value, a, b) for spec, value in zip(self.top_inputs, args)]
                 for a, b in groups]
        views = [self._buffer_rows(buffers, args, a, b) for a, b in groups]
        results = threads.run_each(
            lambda i: self._run(const_args, threads.ALONE, parts[i], views[i]), range(len(groups)))
        outputs, given = [], iter(buffers)
        for spec, is_given, pieces in zip(self.top_outputs, self.given, zip(*results)):
            if is_given:
                outputs.append(self._output(spec, next(given), args))
            elif isinstance(pieces[0], LoDTensor):
                outputs.append(LoDTensor.concat(pieces))
            else:
                outputs.append(np.concatenate(pieces))
        return outputs

    def output_buffers(self, args):
        """New arrays for the outputs program() takes from its caller: an
        all-steps output has a row per step of the top-level sequences, a
        last-step output a row per top-level sequence."""
        buffers = []
        for spec, var, is_given in zip(self.top_outputs, self.program.eqn.outputs, self.given):
            if is_given:
                if spec[0] == "dense_all":
                    rows = int(self._level(spec[2][0], args)[-1])
                else:
                    rows = args[self.first_sequence].num_sequences
                buffers.append(np.empty((rows,) + tuple(var.shape[1:]), var.dtype))
        return buffers

    def _buffer_rows(self, buffers, args, a, b):
        """The rows of each output buffer that top-level sequences ``a:b`` write."""
        views, given = [], iter(buffers)
        for spec, is_given in zip(self.top_outputs, self.given):
            if is_given:
                buffer = next(given)
                if spec[0] == "dense_all":  # rows of the sequence input's coarsest level
                    level = self._level(spec[2][0], args)
                    views.append(buffer[int(level[a]):int(level[b])])
                else:
                    views.append(buffer[a:b])
        return views

    @staticmethod
    def _slice(spec, value, a, b):
        """Top-level sequences ``a:b`` of one program input (a view)."""
        if spec[0] != "sequence":
            return value[a:b]
        levels, lo, hi = [], a, b
        for offsets in value.levels:
            offsets = np.asarray(offsets)
            levels.append(offsets[lo:hi + 1] - offsets[lo])
            lo, hi = int(offsets[lo]), int(offsets[hi])
        return LoDTensor._trusted(value.data[lo:hi], levels)

    def _call_args(self, args):
        """program()'s arguments for the top-level inputs ``args``."""
        call_args = []
        for (kind, _, _, _), value in zip(self.top_inputs, args):
            if kind == "sequence":
                call_args.append(read_only(value.data))
                call_args += [read_only(lv) for lv in value.levels]
            else:
                call_args.append(read_only(value))
        return call_args

    def board(self, rows, num_sequences):
        """The helper's board for a run of one group (:func:`plan.shares`):
        ``threads.BOARD``, the helper woken, or ``threads.ALONE``."""
        if plan.shares(self, rows, num_sequences):
            return threads.board_for_one_group()
        return threads.ALONE

    def _run(self, const_args, board, args, buffers):
        results = self.module.program(*const_args, board, ROWS_IN_ORDER, *self._call_args(args),
                                      *buffers)
        extra = list(results[len(self.top_outputs):])
        return [self._output(spec, arr, args, extra) for spec, arr in zip(self.top_outputs, results)]

    def _output(self, spec, arr, args, extra=None):
        """One output of program() as stepnet returns it (``extra``: the
        second levels of segment outputs, taken in order)."""
        kind = spec[0]
        if kind in ("dense_all", "ragged_all", "segment_memory"):
            return LoDTensor._trusted(arr, [self._level(name, args) for name in spec[2]])
        if kind == "segment_all":  # its second level comes from the kernel
            return LoDTensor._trusted(arr, [self._level(spec[2][0], args), extra.pop(0)])
        return arr  # (a last-step output)

    def _check_same_lod(self, args):
        """Values combined row by row have as many rows: ragged static inputs
        sequence by sequence, two-level step inputs entry by entry, and each
        step of a two-level step input as its sequence of a static input."""
        names = {level: v.name for kind, v, _, levels in self.top_inputs if kind == "sequence"
                 for level in levels}
        steps = {levels[1]: value.levels[0] for (kind, _, _, levels), value
                 in zip(self.top_inputs, args) if kind == "sequence" and len(levels) == 2}
        for a, b in self.same_lod:
            rows, other = np.diff(self._level(a, args)), np.diff(self._level(b, args))
            by_step = b in steps and a not in steps  # (a static input's rows at each step of b)
            if by_step:
                rows = np.repeat(rows, np.diff(steps[b]))
            if not np.array_equal(rows, other):
                raise LoDError(f"{names[a]} and {names[b]} are combined row by row but have "
                               "different lengths" + (" (each step of a two-level step input has "
                                                      "as many rows as its sequence of a static "
                                                      "input)" if by_step else ""))

    def _level(self, name, args):
        for (kind, _, _, levels), value in zip(self.top_inputs, args):
            if kind == "sequence" and name in levels:
                return value.levels[levels.index(name)]
        raise AssertionError(name)


# program()'s ``row_step`` where the data rows are in the LoD's order: step t
# of a top-level sequence at its first row + t. A net of one level over
# sequences of the same length may take its rows by steps instead (ONNX's
# time-major X and Y: step t of sequence b at row t * row_step + b, row_step
# the number of sequences; ``onnx.recurrent``)
ROWS_IN_ORDER = np.int64(1)


# a stand-in of product_timing.small_rows_table()'s type, where only the kernel's
# argument types are asked for (a call before the rows are measured)
_SMALL_ROWS_TYPE = np.zeros((3, 1), np.int64)
_SMALL_ROWS_TYPE.flags.writeable = False


def side_by_side(parts):
    """``parts`` joined by columns as one view of their memory, where they
    are already side by side: views of one array, each row of each part
    right after the same row of the part before (a layer's gate weights:
    ``stepnet.nn``); else None. The view sees a change made in place to a
    part, as the parts do."""
    first = parts[0]
    base, rows, itemsize = first.base, first.shape[0], first.itemsize
    if base is None or first.ndim != 2 or first.strides[1] != itemsize:
        return None
    address = first.__array_interface__["data"][0]
    for p in parts:
        if not (p.base is base and p.ndim == 2 and p.dtype == first.dtype
                and p.shape[0] == rows and p.strides == first.strides
                and p.__array_interface__["data"][0] == address):
            return None
        address += p.shape[1] * itemsize
    width = sum(p.shape[1] for p in parts)
    return np.lib.stride_tricks.as_strided(first, (rows, width), first.strides, writeable=False)


def read_only(array):
    """``array`` C-contiguous and read-only: itself where it is, else a view
    or a copy (the caller's array keeps its flags). The kernel never writes
    its inputs, and one array type for every call means one compiled
    signature."""
    flags = array.flags
    if flags.c_contiguous:
        if not flags.writeable:
            return array
        view = array.view()
    else:  # (a broadcast row made whole: sized first)
        sizes.check_large("an input's rows made contiguous", array.shape, array.dtype)
        view = np.ascontiguousarray(array)
    view.flags.writeable = False
    return view


def compiled_entry(dispatcher, args):
    """The machine code ``dispatcher`` compiled for exactly the types of
    ``args``, as a function called without Numba's type dispatch, or None.

    It costs a microsecond less a call than the dispatcher, and it takes
    writeable arrays where it was compiled for read-only ones (its code
    never writes them), so no read-only view need be made per call. It
    checks nothing: the caller passes arrays of the same dtypes and ranks,
    C-contiguous and aligned (:func:`exactly`), else it reads wrong memory."""
    try:
        return dispatcher.overloads[tuple(numba.typeof(a) for a in args)].entry_point
    except (AttributeError, KeyError, TypeError, ValueError):  # not compiled, or no such attribute
        return None


def exactly(array, dtype, ndim) -> bool:
    """Whether ``array`` may go to a :func:`compiled_entry` in place of an
    array of ``dtype`` and rank ``ndim`` (either writeable or not)."""
    if type(array) is not np.ndarray or array.dtype != dtype or array.ndim != ndim:
        return False
    flags = array.flags
    return flags.c_contiguous and flags.aligned


def compile_program(program: ir.Program):
    """The program on the Numba backend: a :class:`NumbaProgram`, or while
    its kernel is new to this machine and :func:`tiered`, a
    :class:`TieredProgram` running the interpreter until it is compiled."""
    kernel = NumbaProgram(program)
    if tiered() and not kernel.ready and not kernel.compiled_before():
        return TieredProgram(kernel)
    return kernel


def available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True
