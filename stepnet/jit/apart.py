"""Calls of compiled functions *apart*: by the address of their machine code,
their code not linked into the caller's.

Numba links the code of every compiled function a function calls into the
caller's own, optimizes the whole again and makes machine code of it again:
a generated kernel's program() carried its rnn functions and every helper
they call (``blas.pack``, ``gemm_packed``, ``numba_runtime.sort_by_length``
...), each compiled anew in every kernel. The generated kernels call those
apart instead (``call_apart``, ``job_apart``, and the helpers this module
exports under their own names), so each is compiled once (and kept on disk)
and a new kernel compiles its own code only.

A call apart names the callee by a symbol of its own (``stepnet_entry_``
and a hash of the function's module, name and argument types), given to
LLVM (``llvmlite.binding.add_symbol``) as the callee's address before the
caller's machine code is linked: when the caller is compiled, and, when it
is loaded from Numba's disk cache in another process, by a hook Numba runs
first (the library's ``reload_init``, kept with the cached code), which
compiles or loads the callee there.

Only functions no other compiled function links call apart (the generated
kernels' functions): a hook is kept with the code of the function whose
code calls apart, and a caller linking that code from Numba's disk cache
would not have it.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from dataclasses import dataclass

import llvmlite.binding as llvm_binding
from numba.core import cgutils, types
from numba.core.compiler_lock import global_compiler_lock
from numba.extending import intrinsic

from . import blas, numba_runtime, quantized, threads
from .int8_gemm import sums_buffer  # noqa: F401  (the arrays of a kernel's int8 sums)
from .atomics import call_signature, is_int64_array, job_record

_ENTRIES = {}  # symbol -> the compiled function whose address LLVM has, for this process


@dataclass(frozen=True)
class _Entry:
    """The hook giving LLVM the symbol of ``qualname`` (a compiled function
    of module ``module``) for ``argtypes``: compiled or loaded from the disk
    cache if it is not yet. Kept with the caller's cached code (picklable)."""

    module: str
    qualname: str
    argtypes: tuple

    def symbol(self) -> str:
        text = f"{self.module}.{self.qualname}{tuple(str(t) for t in self.argtypes)}"
        return "stepnet_entry_" + hashlib.sha256(text.encode()).hexdigest()[:24]

    def __call__(self):
        module = sys.modules.get(self.module) or importlib.import_module(self.module)
        return _register(getattr(module, self.qualname), self)


def _register(dispatcher, entry):
    """``dispatcher`` compiled (or loaded) for ``entry.argtypes``, its
    native function's address given to LLVM as ``entry.symbol()``: the
    compiled function (Numba's result)."""
    symbol = entry.symbol()
    # (Numba's compiler lock, which a compile of the callee takes: held while
    # compiling a caller, and reentrant for the hooks of a callee's callees)
    with global_compiler_lock:
        if symbol not in _ENTRIES:
            result = dispatcher.overloads.get(entry.argtypes)
            if result is None:
                dispatcher.compile(entry.argtypes)
                result = dispatcher.overloads[entry.argtypes]
            address = result.library.get_pointer_to_function(result.fndesc.llvm_func_name)
            if not address:
                raise RuntimeError(f"stepnet: no machine code for {entry.qualname}{entry.argtypes}")
            llvm_binding.add_symbol(symbol, address)
            _ENTRIES[symbol] = result
        return _ENTRIES[symbol]


def _declare(context, builder, dispatcher, signature):
    """The callee's native function in the caller's module, by its entry
    symbol (registered now, and on every load of the caller's cached code):
    ``(function, fndesc)``."""
    py_func = dispatcher.py_func
    entry = _Entry(py_func.__module__, py_func.__qualname__, tuple(signature.args))
    result = _register(dispatcher, entry)
    context.active_code_library._reload_init.add(entry)
    fndesc = result.fndesc
    function_type = context.call_conv.get_function_type(fndesc.restype, fndesc.argtypes)
    return cgutils.get_or_insert_function(builder.module, function_type, entry.symbol()), fndesc


def _call(context, builder, dispatcher, signature, arguments, values):
    """Call ``dispatcher`` for ``signature`` apart with the tuple ``values``
    (of type ``arguments``), raising what it raised."""
    function, fndesc = _declare(context, builder, dispatcher, signature)
    values = [context.cast(builder, v, t, p) for v, t, p in
              zip(cgutils.unpack_tuple(builder, values, len(arguments)), arguments.types,
                  signature.args)]
    status, result = context.call_conv.call_function(builder, function, fndesc.restype,
                                                     fndesc.argtypes, values)
    with cgutils.if_unlikely(builder, status.is_error):
        context.call_conv.return_status_propagate(builder, status)
    return result


@intrinsic
def call_apart(typingctx, function, arguments):
    """``function(*arguments)`` (a compiled function, a tuple of its
    arguments), called apart."""
    signature = call_signature(typingctx, function, arguments)
    if signature is None:
        return None

    def codegen(context, builder, sig, args):
        return _call(context, builder, function.dispatcher, signature, arguments, args[1])

    return signature.return_type(function, arguments), codegen


def _job(context, builder, sig, function, signature, arguments, values, words=None):
    """``job_record`` for ``function`` called apart (its record at ``words``
    where given, else on the stack)."""
    callee, fndesc = _declare(context, builder, function.dispatcher, signature)
    return job_record(context, builder, sig, (function, values), arguments, signature, callee,
                      fndesc, words=words)


@intrinsic
def job_apart(typingctx, function, arguments):
    """``atomics.job_of(function, arguments)`` with ``function`` called
    apart."""
    signature = call_signature(typingctx, function, arguments)
    if signature is None:
        return None

    def codegen(context, builder, sig, args):
        return _job(context, builder, sig, function, signature, arguments, args[1])

    return types.UniTuple(types.int64, 2)(function, arguments), codegen


@intrinsic
def job_apart_in(typingctx, words, function, arguments):
    """``job_apart`` with the job's record kept in ``words`` (a 1-D int64
    array of at least ``atomics.JOB_WORDS``) instead of on this function's
    stack: a job that outlives the function posting it (its caller keeps
    ``words``, and the arrays in ``arguments``, until the job is done)."""
    signature = call_signature(typingctx, function, arguments)
    if signature is None or not is_int64_array(words):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return _job(context, builder, sig, function, signature, arguments, args[2], words=data)

    return types.UniTuple(types.int64, 2)(words, function, arguments), codegen


def called_apart(dispatcher):
    """An njit-callable calling the helper ``dispatcher`` apart, under its
    name."""

    def call(typingctx, *arguments):
        function = typingctx.resolve_value_type(dispatcher)
        packed = types.StarArgTuple(arguments)  # (how Numba passes ``*arguments``)
        signature = call_signature(typingctx, function, packed)
        if signature is None:
            return None

        def codegen(context, builder, sig, args):
            return _call(context, builder, dispatcher, signature, packed, args[0])

        return signature.return_type(packed), codegen

    call.__name__ = call.__qualname__ = dispatcher.py_func.__name__
    call.__doc__ = f"``{dispatcher.py_func.__module__}.{call.__name__}``, called apart."
    return intrinsic(call)


# the helpers a generated kernel calls apart, under their own names
# (elementwise ones, such as numba_runtime.sigmoid32, are linked: LLVM
# inlines and vectorizes them)
HELPERS = ("gather_steps", "gemm_hoisted", "gemm_hoisted_acc", "gemm_packed", "gemm_steps", "pack",
           "group_cut", "rows_by_steps", "run_jobs", "sort_by_length", "starts_and_lengths")
# those of the quantized products, which only a kernel computing one imports
QUANTIZED_HELPERS = ("int8_rows", "int8_row_sums", "bf16_rows")
gemm_hoisted = called_apart(blas.gemm_hoisted)
gemm_hoisted_acc = called_apart(blas.gemm_hoisted_acc)
gemm_packed = called_apart(blas.gemm_packed)
gather_steps = called_apart(blas.gather_steps)
gemm_steps = called_apart(blas.gemm_steps)
pack = called_apart(blas.pack)
group_cut = called_apart(threads.group_cut)
run_jobs = called_apart(threads.run_jobs)
sort_by_length = called_apart(numba_runtime.sort_by_length)
starts_and_lengths = called_apart(numba_runtime.starts_and_lengths)
rows_by_steps = called_apart(numba_runtime.rows_by_steps)
int8_rows = called_apart(quantized.int8_rows)
int8_row_sums = called_apart(quantized.int8_row_sums)
bf16_rows = called_apart(quantized.bf16_rows)
