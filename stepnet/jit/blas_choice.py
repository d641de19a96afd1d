"""Which BLAS the Numba backend calls: the libraries it can reach, and the
fastest of them on this machine.

The candidates:

- ``mkl``: Intel MKL's single dynamic library (``libmkl_rt``, from the ``mkl``
  wheel or a conda environment) in the Python prefix's ``lib/``, called
  through its CBLAS entry points on its sequential threading layer.
- ``openblas``: scipy's BLAS through its public Cython API
  (``scipy.linalg.cython_blas``: ``sgemm``/``dgemm`` function pointers). Each
  call runs on the calling thread: OpenBLAS's ``openblas_set_num_threads_local``
  (the process's count, not the thread's, in pthreads builds) is looked up in
  the OpenBLAS library the process has loaded.
- ``numpy``: ``np.dot``, when neither is reachable (stepnet warns).

``STEPNET_BLAS`` names one. Unset, stepnet measures the ones it can reach
once per machine, single-threaded, on a per-step product (64 rows) and a
hoisted one (every token), picks the faster and keeps the choice and the
figures in ``STEPNET_CACHE_DIR/blas.json``, keyed by the CPU, the libraries
and what changes their code (``_library_settings``). ``stepnet info`` prints them.

Up to how many rows a per-step product runs stepnet's own loop instead of
the chosen library, and whether the own loop shares a product with the
helper thread (:func:`small_product_rows`), is measured the same way, at the
first compiled call, and kept in ``STEPNET_CACHE_DIR/small_products.json``;
whether the weight gradients' products (``a.T @ b`` over every token) run
stepnet's own loop or the library (:func:`transposed_by_own_loop`), at the
first compiled backward, kept in ``STEPNET_CACHE_DIR/transposed_products.json``.
A process that reads the kept choice or small-product limits times one of
their products again and measures the whole again where they disagree
(:func:`disagreement`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import sys
import threading
import time
import warnings

import numpy as np

from ..config import config
from .cache import cache_dir


# the products measured (m, k, n), repetitions, and the weight of each in the
# score: a per-step product of a 64-row batch (H=256, three gates), run 100
# times per call, and a hoisted one over 2048 tokens, run about 3 times (6400
# tokens)
_SHAPES = ((64, 256, 768, 20, 100), (2048, 128, 768, 3, 3))
# rounds in which the libraries take turns, each timing every product: a
# load that comes and goes on the machine (another tenant of a shared host)
# hits them alike instead of the one measured while it lasts
_ROUNDS = 5


class Library:
    """A reachable BLAS: its name, path and ctypes handle."""

    def __init__(self, name, path, handle):
        self.name, self.path, self.handle = name, path, handle

    def fingerprint(self) -> str:
        try:
            stat = os.stat(self.path)
            return f"{self.path}:{stat.st_size}:{int(stat.st_mtime)}"
        except OSError:
            return self.path


@functools.cache
def find_mkl():
    """``libmkl_rt`` in the Python prefix's ``lib/``, or None."""
    roots = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable))}
    for root in sorted(roots):
        for name in ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so", "libmkl_rt.dylib"):
            path = os.path.join(root, "lib", name)
            if not os.path.exists(path):
                continue
            try:
                handle = ctypes.CDLL(path)
            except OSError:
                continue
            handle.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
            handle.MKL_Set_Threading_Layer(1)  # MKL_THREADING_SEQUENTIAL
            return Library("mkl", path, handle)
    return None


@functools.cache
def find_openblas():
    """scipy's ``cython_blas`` GEMMs (addresses) and the loaded OpenBLAS's
    thread count setter (an address, or None), or None."""
    try:
        from numba.extending import get_cython_function_address

        sgemm = get_cython_function_address("scipy.linalg.cython_blas", "sgemm")
        dgemm = get_cython_function_address("scipy.linalg.cython_blas", "dgemm")
    except (ImportError, ValueError, AttributeError):
        return None
    setter, path = _openblas_thread_setter()
    lib = Library("openblas", path or "scipy.linalg.cython_blas", None)
    lib.sgemm, lib.dgemm, lib.set_threads_local = sgemm, dgemm, setter
    return lib


def _openblas_thread_setter():
    """``openblas_set_num_threads_local`` of the 32-bit-integer OpenBLAS the
    process has loaded (scipy's), from the process's own list of mapped
    libraries; (None, None) where it cannot be found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()
                     and line.split()[-1].startswith("/")}
    except OSError:
        return None, None
    for path in sorted(paths):
        try:
            handle = ctypes.CDLL(path)
            setter = handle.openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        # the 32-bit-integer (LP64) build that cython_blas calls, not numpy's
        # 64-bit-integer one (whose GEMMs end in 64_)
        if any(hasattr(handle, name) for name in ("sgemm_", "scipy_sgemm_")):
            return ctypes.cast(setter, ctypes.c_void_p).value, path
    return None, None


def _mkl_sgemm(lib):
    """``gemm(a, b, c)``: c = a @ b (row-major float32) by MKL's CBLAS."""
    f = lib.handle.cblas_sgemm
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                       ctypes.c_void_p, ctypes.c_int]

    def gemm(a, b, c):
        (m, k), n = a.shape, b.shape[1]
        f(101, 111, 111, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0, c.ctypes.data, n)
    return gemm


def _openblas_sgemm(lib):
    """``gemm(a, b, c)``: c = a @ b (row-major float32) by scipy's OpenBLAS,
    as column-major C^T = B^T A^T, on the calling thread."""
    ref_i, ref_f = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
    proto = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ref_i, ref_i, ref_i, ref_f,
                             ctypes.c_void_p, ref_i, ctypes.c_void_p, ref_i, ref_f,
                             ctypes.c_void_p, ref_i)
    f = proto(lib.sgemm)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def gemm(a, b, c):
        im, ik, i_n = (ctypes.c_int(x) for x in (a.shape[0], a.shape[1], b.shape[1]))
        f(b"N", b"N", ctypes.byref(i_n), ctypes.byref(im), ctypes.byref(ik), ctypes.byref(one),
          b.ctypes.data, ctypes.byref(i_n), a.ctypes.data, ctypes.byref(ik), ctypes.byref(zero),
          c.ctypes.data, ctypes.byref(i_n))
    return gemm


class _single_openblas:
    """OpenBLAS on one thread within the block (the BLAS is measured before
    any kernel of stepnet's runs: none sets the count meanwhile)."""

    def __init__(self, lib):
        setter = getattr(lib, "set_threads_local", None)
        self.setter = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(setter) if setter else None

    def __enter__(self):
        self.old = self.setter(1) if self.setter else None

    def __exit__(self, *exc):
        if self.setter:
            self.setter(self.old)


def _time_mkl(lib, m, k, n, reps):
    gemm, (a, b, c) = _mkl_sgemm(lib), _operands(m, k, n)
    return _best(lambda: gemm(a, b, c), reps)


def _time_openblas(lib, m, k, n, reps):
    gemm, (a, b, c) = _openblas_sgemm(lib), _operands(m, k, n)
    with _single_openblas(lib):
        return _best(lambda: gemm(a, b, c), reps)


def _operands(m, k, n):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32),
            np.empty((m, n), np.float32))


def _best(call, reps):
    call()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(libraries, shapes=_SHAPES) -> dict:
    """Seconds per product, single-threaded, the best over ``_ROUNDS``
    rounds that take the libraries in turn: {name: [per shape]} (``shapes``:
    (m, k, n, repetitions, weight) each)."""
    timers = {"mkl": _time_mkl, "openblas": _time_openblas}
    best = {lib.name: [float("inf")] * len(shapes) for lib in libraries}
    for _ in range(_ROUNDS):
        for lib in libraries:
            for i, (m, k, n, reps, _) in enumerate(shapes):
                seconds = timers[lib.name](lib, m, k, n, max(1, reps // _ROUNDS))
                best[lib.name][i] = min(best[lib.name][i], seconds)
    return best


# how far apart two measurements of a product may be for either to hold
# (a load on the machine while one ran); measurements taken at most
_STEADY = 1.1
_MEASURES = 3


def measure_steadily(libraries, shapes=_SHAPES):
    """``measure`` repeated until its two best results for every product are
    within ``_STEADY`` of each other (``_MEASURES`` times at most): ``(the
    best seconds, noisy)``, ``noisy`` naming the products that were not
    steady (a figure measured while the machine was busy)."""
    runs = [measure(libraries, shapes)]
    while True:
        runs.append(measure(libraries, shapes))
        noisy = [f"{name} {m}x{k} @ {k}x{n}"
                 for name in runs[0] for i, (m, k, n, _, _) in enumerate(shapes)
                 if _spread(sorted(run[name][i] for run in runs)) > _STEADY]
        if not noisy or len(runs) == _MEASURES:
            best = {name: [min(run[name][i] for run in runs) for i in range(len(shapes))]
                    for name in runs[0]}
            return best, noisy


def _spread(seconds):
    return seconds[1] / seconds[0] if seconds[0] > 0 else float("inf")


@functools.cache
def choose() -> dict:
    """The BLAS to use: ``{"name", "reason", "seconds", "cpu", "libraries"}``."""
    return _choose()


def _choose():
    """``choose``'s choice, made (or read from the cache) again."""
    requested = config.engine("blas") or ""  # (what the engine started with, once it has)
    cpu = _cpu_name()
    found = {}
    if requested in ("", "mkl"):
        found["mkl"] = find_mkl()
    if requested in ("", "openblas"):
        found["openblas"] = find_openblas()
    reachable = [lib for lib in found.values() if lib is not None]
    info = {"cpu": cpu, "libraries": {lib.name: lib.path for lib in reachable}, "seconds": {}}
    if requested:
        if requested != "numpy" and found.get(requested) is None:
            warnings.warn(f"stepnet: STEPNET_BLAS={requested} but {_what(requested)} was not "
                          "found; the kernels call np.dot instead", RuntimeWarning, stacklevel=3)
            return dict(info, name="numpy", reason=f"STEPNET_BLAS={requested}, not found")
        return dict(info, name=requested, reason="STEPNET_BLAS")
    if not reachable:
        warnings.warn("stepnet: no BLAS found (tried MKL's libmkl_rt in the Python prefix and "
                      "scipy.linalg.cython_blas); the kernels call np.dot, and run slower",
                      RuntimeWarning, stacklevel=3)
        return dict(info, name="numpy", reason="no BLAS found")
    if len(reachable) == 1:
        return dict(info, name=reachable[0].name, reason="the only one found")
    key = hashlib.sha256(";".join([cpu, _library_settings()]
                                  + sorted(lib.fingerprint() for lib in reachable))
                         .encode()).hexdigest()[:16]
    names = [lib.name for lib in reachable]
    saved, off = _blas_record(_kept("blas.json", key), names), None
    if saved is not None and saved.get("name") in found:
        def now():
            seconds = measure(reachable, _SHAPES[:1])
            return [seconds[lib.name][0] for lib in reachable]

        off = disagreement([saved.get("seconds", {}).get(lib.name, [0])[0] for lib in reachable],
                           now)
        if off is None:
            return dict(info, name=saved["name"], seconds=saved.get("seconds", {}),
                        reason=saved.get("reason", "measured") + " (cached)")
    seconds, noisy = measure_steadily(reachable)
    name = min(seconds, key=lambda n: sum(s * shape[-1] for s, shape in zip(seconds[n], _SHAPES)))
    reason = _measured(off) + (f"; noisy, the machine was busy ({', '.join(noisy)} not steady over "
                           f"{_MEASURES} measurements): `stepnet info --measure` measures again"
                           if noisy else "")
    result = dict(info, name=name, reason=reason, seconds=seconds)
    # (another's, measured at once; not the one measured again)
    kept = _blas_record(_keep("blas.json", dict(result, key=key), first=off is None), names)
    return result if kept is None or kept["name"] == name or kept.get("name") not in found else dict(
        info, name=kept["name"], reason=kept.get("reason") + " (cached)", seconds=kept["seconds"])


def _blas_record(saved, names):
    """``saved`` where it has the form ``_choose`` writes, else None (a file
    edited or written by another version: measured again, not an error)."""
    try:
        if (isinstance(saved["name"], str) and isinstance(saved.get("reason", ""), str)
                and all(float(saved["seconds"][n][0]) >= 0 for n in names)):
            return saved
    except (TypeError, KeyError, IndexError, ValueError):
        pass
    return None


def _kept(filename, key):
    """What ``_keep`` wrote to ``STEPNET_CACHE_DIR/filename`` under ``key``,
    or None (none, another key, or unreadable)."""
    try:
        saved = json.loads((cache_dir() / filename).read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and saved.get("key") == key else None


def _keep(filename, result, first=False):
    """``result`` (with its key) to ``STEPNET_CACHE_DIR/filename``, whole or not at all;
    ``first``: unless another process kept one under its key meanwhile, then what
    is kept (processes that measured at once share one choice, and a worker)."""
    path = cache_dir() / filename
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(result, indent=1))
        try:
            os.link(tmp, path)  # (only where no file is there)
        except FileExistsError:
            kept = _kept(filename, result["key"]) if first else None
            if kept is not None:
                return kept
            os.replace(tmp, path)  # (another key's, or unreadable: replaced)
    except OSError:
        pass  # (an unwritable cache is measured again next time)
    finally:
        tmp.unlink(missing_ok=True)
    return result


def _measured_key(form, choice) -> str:
    """The key of a measurement of stepnet's own loop in the ``form`` named
    against the library ``choice`` names, on this CPU."""
    library = choice["libraries"].get(choice["name"], choice["name"])
    return hashlib.sha256(f"{form};{choice['cpu']};{choice['name']};{library};"
                          f"{_library_settings()}".encode()).hexdigest()[:16]


def _library_settings() -> str:
    """What changes a measured product's code beside the CPU's name: the libraries' variables,
    the CPU's vector instructions (machines of one name differ) and those Numba compiles for."""
    from .own_loop import compiled_features, host_features

    return ";".join([f"{v}={os.environ.get(v, '')}" for v in ("OPENBLAS_CORETYPE", "MKL_CBWR",
                     "MKL_ENABLE_INSTRUCTIONS")] + sorted(host_features())
                    + ["compiled"] + sorted(compiled_features()))


# the per-step products that set the small-product limits: recurrent weights
# [k, n] from 48 KiB to 4 MiB (float32; GRUs of 64, 128 and 256 units, an
# LSTM of 256 and one of 512), batches of 1 to 64 rows
_STEP_WEIGHTS = ((64, 192), (128, 384), (256, 768), (256, 1024), (512, 2048))
_STEP_ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
# the product of those timed again where the kept limits are read
_CHECKED = (64, 256, 768)
# the form of stepnet's own loop measured (a measurement of another form,
# kept in the cache, is not used)
_OWN_LOOP = ("6x32 and 4x32 row blocks on 32-column weight panels, one row by 192, 128 or 64 "
             "columns, the widest vectors; shared with the helper where measured faster in a time "
             "loop by a tenth; every product where faster by a tenth over 1024 rows as run outside")
# a product over more rows than measured (over every token, outside the time
# loop) runs the own loop where it won by a tenth over this many rows there
_MANY_ROWS = 1024
_EVERY_WINS = 0.9
_SMALL_PRODUCTS = {}  # dtype -> what small_product_rows found, for describe()
# a limit, of rows or of weight elements, that no product reaches
EVERY_PRODUCT = 1 << 62


def _busy_seconds():
    """The machine's busy CPU seconds so far, every core (Linux's
    ``/proc/stat``), or None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # (idle, iowait)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


# a kept measurement is taken again where its product, timed again on free
# cores, took more than this factor more or less time than it says: it was
# taken while the machine was busy, or the machine changed under it
DISAGREES = 2.0


def disagreement(kept, probe):
    """The largest factor, either way, between the ``kept`` seconds of some
    products and ``probe()``'s of the same products now (timed on free
    cores: ``measured_on_free_cores``) where it is over ``DISAGREES``; else
    None (they agree, or other processes kept the cores busy: a busy
    machine judges nothing). Each process checks a kept measurement once,
    where it first reads it."""
    now, _ = measured_on_free_cores(probe, tries=1)
    if now is None:
        return None
    factor = max([max(k / n, n / k) for k, n in zip(kept, now) if k > 0 and n > 0], default=1.0)
    return factor if factor > DISAGREES else None


def _measured(off):
    """The reason of a measurement: taken anew, or again where the kept one
    was ``off`` (a factor) from the products timed now."""
    return "measured" if off is None else \
        f"measured again (the kept figures were {off:.1f}x off the products timed now)"


# other processes' load (cores, on average) over which a measurement of a
# product cut with the helper is not taken: the helper had no core of its own
_FOREIGN_CORES = 0.25


def measured_on_free_cores(measure, tries=3):
    """``(measure(), True)`` where no other process took more than
    ``_FOREIGN_CORES`` of the machine while it ran and 50 ms before (the
    busy time of every core, ``/proc/stat``, less this process's own),
    tried up to ``tries`` times; ``(None, False)`` where every try had
    company. A cut measured while another process keeps the second core
    busy (a first call's interpreter beside the compile worker that
    measures) loses to the product alone however fast it is on a free core.
    Where the load cannot be read, the first try's."""
    for _ in range(tries):
        busy, own, start = _busy_seconds(), time.process_time(), time.perf_counter()
        if busy is None:
            return measure(), True
        # the load is watched from 50 ms before (the counters tick by 10 ms: a
        # measurement of a few ms alone is not judged)
        time.sleep(0.05)
        result = measure()
        wall = time.perf_counter() - start
        foreign = (_busy_seconds() - busy) - (time.process_time() - own)
        if foreign <= _FOREIGN_CORES * wall:
            return result, True
    return None, False


def small_product_rows(choice, time_both, time_shared=None, check=True, time_many=None, measure=True,
                       dtype="float32"):
    """Up to how many rows a product runs stepnet's own loop instead of the
    library's (a per-step product, or one outside the time loop over every
    step's rows), and whether the own loop shares it with the helper, by
    the size of its weights: ``((k * n, rows, shares), ...)`` by size (a
    product takes the entry of the next larger size measured, or the
    largest). ``STEPNET_SMALL_PRODUCTS=rows`` sets one limit for every size
    (shared as the kernel's board allows); else measured once per machine,
    library and ``dtype`` (``time_both(m, k, n)``: the seconds of each, one
    thread; ``time_shared(m, k, n)``: the own loop's seconds alone and cut with the
    helper, or None where it is never cut) and kept in
    ``STEPNET_CACHE_DIR/small_products.json`` (float64's in
    ``small_products_float64.json``). For each size the limit is the
    one with the least total time over the rows measured, each counted
    relative to the faster of the two (a one-row product weighs as much as a
    256-row one, and a near tie cannot move the limit far); where the own
    loop is best up to the most rows measured, it takes every product of
    that size (``EVERY_PRODUCT``) only if over ``_MANY_ROWS`` rows, run as
    outside the time loop (``time_many(m, k, n)``, on free cores), it took
    at most ``_EVERY_WINS`` of the library's time. A size is shared where a
    one-row product cut with the helper took at most ``SHARE_WINS`` of its
    time alone, in a time loop (the cut pays for two handoffs between
    cores); where not measured (another process kept a core busy:
    ``measured_on_free_cores``; the file says so), it is shared. A kept
    table is checked where ``check`` (``disagreement``: ``_CHECKED`` again);
    none kept and not ``measure``: None."""
    requested = config.start_engine("small_products")  # (what the engine started with)
    if requested is not None:
        limits = ((EVERY_PRODUCT, requested, 1),)
        _SMALL_PRODUCTS[dtype] = {"limits": limits, "reason": "STEPNET_SMALL_PRODUCTS",
                                  "points": [], "shared": []}
        return limits
    return _measured_small_rows(choice, time_both, time_shared, check, time_many, measure, dtype)


# a size of weights is shared with the helper where its one-row product cut
# took at most this share of its time alone: a near tie flips with noise, and
# a kernel's handoffs cost more than the time loop's (a one-sequence GRU of
# 128 units ran markedly slower shared where the cut measured barely faster)
SHARE_WINS = 0.9


def _measured_small_rows(choice, time_both, time_shared, check, time_many, measure, dtype):
    """``small_product_rows``' limits as measured, or as kept."""
    key = _measured_key(f"{_OWN_LOOP}; {dtype}", choice)
    name = "small_products.json" if dtype == "float32" else f"small_products_{dtype}.json"
    saved, off = _kept(name, key), None
    try:
        if saved is not None:
            limits = tuple((int(size), int(rows), int(shares))
                           for size, rows, shares in saved["limits"])
            kept = [(own, lib) for m, k, n, own, lib in saved["points"] if (m, k, n) == _CHECKED]
            off = disagreement(kept[0], lambda: time_both(*_CHECKED)) if kept and check else None
            if off is None:
                _SMALL_PRODUCTS[dtype] = dict(saved, limits=limits, reason="measured (cached)")
                return limits
    except (ValueError, TypeError, KeyError):
        pass  # a file of another form: measured again
    if not measure:
        return None
    points = [(m, k, n, *time_both(m, k, n)) for k, n in _STEP_WEIGHTS for m in _STEP_ROWS]
    shared, crowded = [], 0
    for k, n in _STEP_WEIGHTS:
        seconds, free = None, True
        if time_shared is not None:
            seconds, free = measured_on_free_cores(lambda k=k, n=n: time_shared(1, k, n))
        if seconds is not None and seconds[1] > SHARE_WINS * seconds[0]:
            # a cut that lost is measured again, the best of each side kept: an
            # occasional measurement runs the cut far slower than the others
            # do, and than the kernels run it
            again, _ = measured_on_free_cores(lambda k=k, n=n: time_shared(1, k, n))
            seconds = seconds if again is None else tuple(map(min, seconds, again))
        crowded += not free
        if seconds is not None:
            shared.append((1, k, n, *seconds))
    limits, many = [], []
    for k, n in _STEP_WEIGHTS:
        times = [(m, own, lib) for m, kk, nn, own, lib in points if (kk, nn) == (k, n)]

        def cost(rows, times=times):
            return sum((own if m <= rows else lib) / min(own, lib) for m, own, lib in times)

        rows = min([0] + [m for m, _, _ in times], key=cost)
        shares = all(cut <= SHARE_WINS * alone for _, kk, nn, alone, cut in shared
                     if (kk, nn) == (k, n))
        if rows == _STEP_ROWS[-1] and time_many is not None:
            seconds, _ = measured_on_free_cores(lambda k=k, n=n: time_many(_MANY_ROWS, k, n), tries=2)
            many += [] if seconds is None else [(_MANY_ROWS, k, n, *seconds)]
            rows = EVERY_PRODUCT if seconds and seconds[0] <= _EVERY_WINS * seconds[1] else rows
        limits.append((k * n, rows, int(shares)))
    limits = tuple(limits)
    result = {"key": key, "limits": limits, "points": points, "shared": shared, "many": many,
              "crowded": crowded}
    _SMALL_PRODUCTS[dtype] = dict(result, reason=_measured(off) + (
        f"; the cut with the helper not for {crowded} sizes, shared: other processes kept the "
        "cores busy (`stepnet info --measure` measures again)" if crowded else ""))
    _keep(name, result)
    return limits


# the weight gradients' product measured (and the form of the own loop's):
# a.T @ b over a call's tokens, not a chunk's (a library's rate can fall as
# they grow), 64 sequences of 64 steps, by a GRU of 128 units' gate gradients
_TN_SHAPE = (4096, 128, 384)
_OWN_TN = f"own loop on 256-row chunks: b's panels, a read transposed; {_TN_SHAPE}"
_TRANSPOSED = {}  # dtype -> what transposed_by_own_loop found, for describe()


def transposed_by_own_loop(choice, time_both, dtype="float32") -> bool:
    """Whether the weight gradients' products ``a.T @ b`` of ``dtype``
    (long reductions over every token: ``transposed.transposed_product``) run
    stepnet's own loop rather than the library's: the faster one on
    ``_TN_SHAPE``, one thread (``time_both(rows, m, n, dtype)``: the seconds
    of each), measured once per machine, library and dtype and kept in
    ``STEPNET_CACHE_DIR/transposed_products.json`` (a record per dtype); a
    kept record is checked where first read (``disagreement``: one taken
    while the machine was busy is measured again)."""
    key = _measured_key(_OWN_TN, choice)
    saved = _kept("transposed_products.json", key)
    measured = {}
    try:
        if saved is not None:
            measured = {name: [float(own), float(lib)]
                        for name, (own, lib) in saved["seconds"].items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        measured = {}  # a file of another form: measured again
    off = disagreement(measured[dtype], lambda: time_both(*_TN_SHAPE, dtype)) \
        if dtype in measured else None
    if dtype in measured and off is None:
        reason = "measured (cached)"
    else:
        measured[dtype] = [float(s) for s in time_both(*_TN_SHAPE, dtype)]
        reason = _measured(off)
        _keep("transposed_products.json", {"key": key, "shape": _TN_SHAPE, "seconds": measured})
    for name, seconds in measured.items():
        _TRANSPOSED[name] = {"seconds": tuple(seconds),
                             "reason": reason if name == dtype else "measured (cached)"}
    own, lib = measured[dtype]
    return own < lib


def _what(name):
    return {"mkl": "MKL (libmkl_rt; pip install mkl)",
            "openblas": "scipy.linalg.cython_blas"}[name]
