"""The process that compiles kernels for the Numba backend's first tier:
``python -m stepnet.jit.compile_worker``.

While a new kernel compiles here, the process that asked for it answers on the
NumPy interpreter (numba_cpu.TieredProgram); a separate process keeps the
compile from taking the interpreter's share of the GIL. Requests come one a
line on standard input (JSON: ``key``, the kernel module's ``module`` name and
``path``, the ``function`` of it to compile (``program``, or an ONNX session's
``fused`` loop), the ``blas`` it calls, and ``signature``, its argument types
pickled and base64-encoded; or, with ``function`` ``transposed_products``
and a ``dtype``, the weight gradients' product, measured and compiled:
``blas.prepare_transposed_products``);
each kernel is compiled into Numba's disk cache under ``STEPNET_CACHE_DIR``
and marked ready there (``stepnet_kernel_<key>.ready``), and one line answers
on standard output: ``{"key": ..., "ok": true}`` or ``{"key": ..., "error":
"..."}``. It exits at the end of its input, or when the process that asked
has ended (after the kernel it is compiling).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import pickle
import sys
from pathlib import Path


def compile_kernel(request) -> None:
    from stepnet.jit import blas, numba_cpu  # (numba_cpu also sets LLVM's vectorizer limits)

    if blas.SIGNATURE != request["blas"]:  # the kernel would call another library
        raise RuntimeError(f"this process uses {blas.SIGNATURE}, the kernel {request['blas']}")
    if request.get("function") == "transposed_products":  # not a kernel: the weight
        blas.prepare_transposed_products(request["dtype"])  # gradients' product
        return
    name, path = request["module"], request["path"]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    numba_cpu.link_helpers(module)
    function = getattr(module, request.get("function", "program"))
    function.compile(pickle.loads(base64.b64decode(request["signature"])))
    blas.small_rows_table()  # measured here, not in the first compiled call, where it is new
    try:  # the mark numba_cpu looks for: a later process loads the kernel at once
        Path(path).with_suffix(".ready").touch()
    except OSError:
        pass


def main() -> int:
    for line in sys.stdin:
        request = json.loads(line)
        try:
            compile_kernel(request)
            reply = {"key": request["key"], "ok": True}
        except Exception as exc:  # noqa: BLE001  (reported to the process that asked)
            reply = {"key": request["key"], "error": f"{type(exc).__name__}: {exc}"}
        try:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
        except OSError:  # the asking process has ended
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
