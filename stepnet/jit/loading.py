"""Kernels found, loaded and tiered (every backend, the ONNX fused loops): a
kernel's key, its module loaded once per process from ``STEPNET_CACHE_DIR``,
the mark that it is compiled, the compile worker, and the first tier while
a new kernel compiles (:class:`TieredProgram`, ``sn.config.tiered``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading

import numpy as np

from .. import executor, interpreter
from ..config import config
from ..errors import UnsupportedError
from . import compile_worker as compile_worker_module
from .cache import cache_dir, helpers_fingerprint

_MODULES = {}
_LOADING = threading.RLock()


def kernel_key(source: str) -> str:
    # the key covers what a cached kernel embeds besides its own source: the
    # helpers it calls and the settings they were built with (cache.py)
    return hashlib.sha256((source + helpers_fingerprint()).encode()).hexdigest()[:24]


def ready_marker(key: str):
    """The file saying that a kernel was compiled into the disk cache."""
    return cache_dir() / f"stepnet_kernel_{key}.ready"


def mark_ready(key: str) -> None:
    """Say that kernel ``key`` is in the disk cache (``ready_marker``)."""
    try:
        ready_marker(key).touch()
    except OSError:  # a read-only or removed cache directory: the next process compiles
        pass


def link_helpers(module) -> None:
    """Give LLVM the symbols a generated ``module``'s kernels call: small_gemm's
    C entry for each dtype of its products (``blas.register_small_gemm``:
    compiled, or loaded from the disk cache, once per process). Before its
    program() is compiled or loaded, not when the module is loaded: a tiered
    first call answers on the first tier without waiting for that compile,
    which the compile worker does (and caches) with the kernel's."""
    from . import blas  # (here: the CUDA backend loads its kernels without a CPU BLAS)

    for name in getattr(module, "SMALL_GEMM_DTYPES", ()):
        blas.register_small_gemm(name)


def load_source(source: str):
    """The module of generated ``source``, loaded once per process from its
    file in ``STEPNET_CACHE_DIR`` (named by a hash of it, beside Numba's disk
    cache of its compiled functions)."""
    key = kernel_key(source)
    if key in _MODULES:
        return _MODULES[key]
    with _LOADING:  # (threads of one process meeting the same new kernel: one loads it)
        if key in _MODULES:
            return _MODULES[key]
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"stepnet_kernel_{key}.py"
        if not path.exists() or path.read_bytes() != source.encode():  # new, or not ours
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                tmp.write_text(source)
            except OSError as exc:  # (a read-only folder, filled ahead without this kernel)
                raise UnsupportedError(
                    f"STEPNET_CACHE_DIR {directory} holds no kernel for this step-net and cannot "
                    f"take one ({exc.strerror}): compile it there ahead (stepnet compile, "
                    "sn.compile_ahead), or give a folder stepnet can write") from None
            os.replace(tmp, path)
        _MODULES[key] = module = import_file(f"stepnet_kernel_{key}", path)
        return module


def import_file(name, path):
    """The module ``name`` of the Python file ``path``, imported (and in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class TieredProgram:
    """A program whose kernel no process has compiled on this machine, in two
    tiers: calls run on the first tier, the schedule executor (its runs op by
    op until its loops are compiled, once per install) or the interpreter
    (``sn.config.first_tier``, or a program the executor does not run), while
    the compile worker (:mod:`stepnet.jit.compile_worker`) compiles the kernel
    into the disk cache for the argument types of the first call; the first
    call after that loads it, and every call from then on runs the kernel.
    ``wait()`` blocks until then. If the worker fails, the kernel compiles in
    this process at the next call, and its errors are raised there."""

    def __init__(self, kernel):
        self.numba_program = kernel
        self.program = kernel.program
        self.source = kernel.source
        self.schedule = kernel.schedule
        # the first tier: the schedule executor where it runs the program,
        # else the interpreter
        self._executor = executor.compile_program(kernel.program, kernel.schedule)
        self._interpreted = interpreter.compile_program(kernel.program)
        self._signature = None
        self._compiled = threading.Event()  # set when the worker has answered
        self.worker_error = None  # what the worker said went wrong (the kernel then compiles here)
        self._done = False
        self.answered_by = None  # the tier of the last call: "executor", "interpreter", "kernel"

    @property
    def ready(self) -> bool:
        """Whether calls now run the compiled kernel."""
        return self._done

    def __call__(self, args, consts):
        if not self._done:
            if self._signature is None:
                self._signature = self.numba_program.signature(args, consts)
                try:
                    compile_worker().submit(self.numba_program, self._signature, self._answered)
                except OSError as exc:  # no worker: compile here
                    self._answered(f"the compile worker did not start: {exc}")
                if self._executor is not None and config.first_tier == "executor":
                    self._executor.prepare()  # (its loops, once per install: after the kernel)
            if not self._compiled.is_set():  # (off the worker's core)
                if self._executor is not None and config.first_tier == "executor":
                    self.answered_by = "executor"
                    return self._executor(args, consts, workers=interpreter.cores_beside_a_compile())
                self.answered_by = "interpreter"
                with interpreter.numpy_blas_beside_a_compile():
                    return self._interpreted(args, consts)
            self._finish()
        self.answered_by = "kernel"
        return self.numba_program(args, consts)

    def _answered(self, error):
        self.worker_error = error
        self._compiled.set()

    def _finish(self):
        """Load the kernel the worker compiled (or compile it here)."""
        self.numba_program.compile(self._signature)
        self._done = True

    def wait(self, timeout=None) -> bool:
        """Block until the kernel runs (``timeout`` seconds at most for the
        worker); whether it does."""
        if not self._done and self._signature is not None and self._compiled.wait(timeout):
            self._finish()
        return self._done


def compile_worker():
    """This cache directory's compile worker (:mod:`stepnet.jit.compile_worker`)."""
    return compile_worker_module.worker(cache_dir())


_PREPARED = set()  # (cache directory, dtype) whose weight gradients' product was asked for


def prepare_weight_gradients(dtype) -> None:
    """Have the compile worker measure and compile the weight gradients'
    product for ``dtype`` (``transposed.prepare_transposed_products``), once per
    cache directory: a backward's first calls, on the first tier, sum its
    weight gradients without it; its first compiled call then finds the
    product in the disk cache, instead of compiling it (1-2 s) on the
    caller's thread."""
    from . import blas

    name = np.dtype(dtype).name
    if (cache_dir(), name) in _PREPARED or name not in ("float32", "float64"):
        return
    _PREPARED.add((cache_dir(), name))
    try:
        compile_worker().send({"key": f"transposed products {name}",
                               "function": "transposed_products", "dtype": name,
                               "blas": blas.SIGNATURE}, lambda error: None)
    except OSError:  # no worker: the first compiled call compiles it
        pass


def tiered() -> bool:
    """Whether a new kernel answers on the first tier (``first_tier``) while
    it compiles: ``STEPNET_TIERED`` (``0`` waits for the compiled kernel; on
    by default). Never under ``STEPNET_DETERMINISTIC=1``, whose results must
    not depend on which tier ran."""
    from . import blas

    return config.tiered and not blas.DETERMINISTIC
