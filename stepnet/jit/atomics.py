"""What compiled code on two threads needs to hand work to each other without
the operating system: atomic loads, stores and compare-exchanges of one
``int64`` element of an array, a pause for spin loops, a yield of the core,
the cycle counter, a pointer from an address, a call of a C function at an
address, a buffer on the stack, and a call of a compiled function packed as
a job another thread can run (Numba has none of these for the CPU); and
``wide_vectors``, which lets LLVM vectorize a function with the CPU's widest
vectors.

Spinning is for x86-64 (``SPINS``): there the pause is the ``pause``
instruction and the clock ``rdtsc``; elsewhere no thread spins, and these
compile to a plain loop and a clock of 0.
"""

from __future__ import annotations

import platform
import sys

from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

# whether a thread may spin on this machine (and read its cycle counter)
SPINS = platform.machine().lower() in ("x86_64", "amd64")
_POSIX = sys.platform.startswith(("linux", "darwin", "freebsd"))


def _element_pointer(context, builder, array_type, array, index):
    view = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, view, [index])


def _element(dtype):
    """The element type of a dtype or NumPy scalar type argument (else None)."""
    if isinstance(dtype, types.DType):
        return dtype.dtype
    if isinstance(dtype, types.NumberClass):
        return dtype.instance_type
    return None


def is_int64_array(array):
    return isinstance(array, types.Array) and array.dtype == types.int64 and array.ndim == 1


@intrinsic
def load_acquire(typingctx, array, index):
    """``array[index]`` read after every write another thread released before
    it (``array``: 1-D int64, ``index`` in bounds)."""
    if not is_int64_array(array):
        return None

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(pointer, "acquire", 8)

    return types.int64(array, types.intp), codegen


@intrinsic
def store_release(typingctx, array, index, value):
    """``array[index] = value``, after every write before it is visible."""
    if not is_int64_array(array):
        return None

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(value, pointer, "release", 8)
        return context.get_dummy_value()

    return types.void(array, types.intp, types.int64), codegen


@intrinsic
def compare_exchange(typingctx, array, index, expected, new):
    """Atomically: if ``array[index] == expected``, set it to ``new``; whether
    it did."""
    if not is_int64_array(array):
        return None

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        old = context.cast(builder, args[2], signature.args[2], types.int64)
        value = context.cast(builder, args[3], signature.args[3], types.int64)
        result = builder.cmpxchg(pointer, old, value, "acq_rel", "acquire")
        return builder.extract_value(result, 1)

    return types.boolean(array, types.intp, types.int64, types.int64), codegen


@intrinsic
def pause(typingctx):
    """A spin loop's hint to the core (x86's ``pause``; nothing elsewhere)."""

    def codegen(context, builder, signature, args):
        if SPINS:
            hint = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(hint, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def yield_core(typingctx):
    """Let another thread have this core (``sched_yield``; nothing where
    there is none)."""

    def codegen(context, builder, signature, args):
        if _POSIX:
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
            builder.call(function, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def cycles(typingctx):
    """The core's time-stamp counter (0 where ``SPINS`` is false)."""

    def codegen(context, builder, signature, args):
        if not SPINS:
            return context.get_constant(types.int64, 0)
        clock = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter")
        return builder.call(clock, [])

    return types.int64(), codegen


@intrinsic
def pointer_to(typingctx, address, dtype):
    """The address ``address`` (an integer) as a pointer to ``dtype`` (a
    dtype or a NumPy scalar type)."""
    element = _element(dtype)
    if element is None or not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        target = context.get_value_type(element).as_pointer()
        return builder.inttoptr(args[0], target)

    return types.CPointer(element)(address, dtype), codegen


@intrinsic
def call_address(typingctx, address, record):
    """Call the C function ``void f(int64 *record)`` at ``address`` with the
    data of ``record`` (a 1-D int64 array)."""
    if not isinstance(address, types.Integer) or not is_int64_array(record):
        return None

    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[1])(context, builder, args[1])
        function_type = ir.FunctionType(ir.VoidType(), [ir.IntType(64).as_pointer()])
        function = builder.inttoptr(args[0], function_type.as_pointer())
        builder.call(function, [view.data])
        return context.get_dummy_value()

    return types.void(address, record), codegen


@intrinsic
def as_read_only(typingctx, array):
    """``array`` itself, typed read-only: a helper called with weights a
    kernel computed (a transpose, a join) and with weights given read-only
    compiles once, not once for each."""
    if not isinstance(array, types.Array):
        return None
    result = array.copy(readonly=True)

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, result, args[0])

    return result(array), codegen


# LLVM's X86 attribute for the width of the vectors its vectorizers make
_VECTOR_WIDTH = '"prefer-vector-width"="512"'


@intrinsic
def wide_vectors(typingctx):
    """Vectorize the calling function with the widest vectors the CPU has
    (512 bits with AVX-512; where it has narrower ones, those). LLVM's tuning
    for some AVX-512 server cores prefers 256-bit vectors for every
    function, which halves the multiply-adds a cycle of
    stepnet's products and gate loops there; the attribute is the calling
    function's only (llvmlite knows no string attributes: it is added to the
    function's set as written in LLVM IR)."""

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, _VECTOR_WIDTH)
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def stack_buffer(typingctx, size, dtype):
    """A pointer to ``size`` (a literal) elements of ``dtype`` on the stack:
    LLVM keeps such a block in registers across a loop that reads and writes
    only constant offsets of it."""
    element = _element(dtype)
    if not isinstance(size, types.IntegerLiteral) or element is None:
        return None
    count = size.literal_value

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, context.get_value_type(element), size=count)

    return types.CPointer(element)(size, dtype), codegen


def call_signature(typingctx, function, arguments):
    """The signature of the compiled function ``function`` (its type) called
    with ``arguments`` (a tuple's type; literals as their plain types: one
    compile for both); None where it cannot be called so."""
    if not isinstance(function, types.Dispatcher) or not isinstance(arguments, types.BaseTuple):
        return None
    plain = tuple(types.unliteral(t) for t in arguments.types)
    return typingctx.resolve_function_type(function, plain, {})


@intrinsic
def job_of(typingctx, function, arguments):
    """``function(*arguments)`` (a compiled function, a tuple of its
    arguments) as a job for another thread: ``(address, record)``, the
    address of a C function ``void f(int64 *job)`` that calls ``function``
    with the arguments stored at the address ``job[0]``, and the address of
    such a record: the arguments, kept on this function's stack (alive until
    it returns), after an int64 that the call sets to 1 where ``function``
    raised (else 0). The arrays in ``arguments`` are not referenced: the
    caller keeps them alive until the job is done."""
    signature = call_signature(typingctx, function, arguments)
    if signature is None:
        return None

    def codegen(context, builder, sig, args):
        result = function.dispatcher.overloads[tuple(signature.args)]
        context.add_linking_libs([result.library])
        callee = context.declare_function(builder.module, result.fndesc)
        return job_record(context, builder, sig, args, arguments, signature, callee, result.fndesc)

    return types.UniTuple(types.int64, 2)(function, arguments), codegen


# the int64 words a job's record kept in an array may take (``apart.job_apart_in``)
JOB_WORDS = 128


def job_record(context, builder, sig, args, arguments, signature, callee, fndesc, words=None):
    """``job_of``'s ``(address, record)`` for ``callee`` (``fndesc``'s native
    function, declared in the caller's module) called with ``args[1]`` (of
    types ``arguments``) as ``signature``'s arguments; the record on the
    caller's stack, or at ``words`` (a pointer to ``JOB_WORDS`` int64)."""
    parameters = types.Tuple(tuple(signature.args))
    record_type = ir.LiteralStructType([ir.IntType(64), context.get_value_type(parameters)])
    caller = _job_function(context, builder.module, callee, fndesc, parameters, record_type)
    values = cgutils.unpack_tuple(builder, args[1], len(arguments))
    values = [context.cast(builder, v, t, p)
              for v, t, p in zip(values, arguments.types, parameters.types)]
    if words is None:
        record = cgutils.alloca_once(builder, record_type)
    else:
        if context.get_abi_sizeof(record_type) > 8 * JOB_WORDS:
            raise TypingError(f"stepnet: a job's record of {context.get_abi_sizeof(record_type)} "
                              f"bytes does not fit in JOB_WORDS ({JOB_WORDS})")
        record = builder.bitcast(words, record_type.as_pointer())
    builder.store(ir.Constant(ir.IntType(64), 0), cgutils.gep_inbounds(builder, record, 0, 0))
    builder.store(context.make_tuple(builder, parameters, values),
                  cgutils.gep_inbounds(builder, record, 0, 1))
    address = builder.ptrtoint(caller, ir.IntType(64))
    return context.make_tuple(builder, sig.return_type,
                              [address, builder.ptrtoint(record, ir.IntType(64))])


def _job_function(context, module, callee, fndesc, parameters, record_type):
    """The C function of a job calling ``callee`` (``fndesc``'s native
    function, declared in ``module``): one per module and callee."""
    name = f"stepnet_job.{callee.name}"
    if name in module.globals:
        return module.globals[name]
    word = ir.IntType(64)
    function = ir.Function(module, ir.FunctionType(ir.VoidType(), [word.as_pointer()]), name)
    function.linkage = "internal"
    builder = ir.IRBuilder(function.append_basic_block("entry"))
    record = builder.inttoptr(builder.load(function.args[0]), record_type.as_pointer())
    values = builder.load(cgutils.gep_inbounds(builder, record, 0, 1))
    values = cgutils.unpack_tuple(builder, values, len(parameters))
    # (not inlined: the function's code once in its caller's library, not twice)
    status, value = context.call_conv.call_function(builder, callee, fndesc.restype,
                                                    fndesc.argtypes, values, attrs=("noinline",))
    if context.enable_nrt:  # (the function's result is not used)
        with builder.if_then(status.is_ok):
            context.nrt.decref(builder, fndesc.restype, value)
    builder.store(builder.zext(status.is_error, word), cgutils.gep_inbounds(builder, record, 0, 0))
    builder.ret_void()
    return function
