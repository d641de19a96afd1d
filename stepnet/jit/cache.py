"""Where stepnet keeps what it compiles: one directory, ``STEPNET_CACHE_DIR``.

Layout (default root: ``$XDG_CACHE_HOME/stepnet``, else ``~/.cache/stepnet``)::

    STEPNET_CACHE_DIR/
        stepnet_kernel_<hash>.py      generated kernels (numba_cpu), by a hash of their source
        __pycache__/                  Numba's compiled code of those kernels
        numba/<build>/jit/            Numba's compiled code of stepnet's own helpers
                                      (numba_runtime, blas, threads), one folder per
                                      build, stale when any of their files changes
        */save.lock                   held while Numba adds to an index in that folder
        compile_worker.lock, .sock, .json
                                      the compile worker serving this directory
                                      (stepnet.jit.compile_worker)

Nothing is written into the installed package: importing this module puts a
Numba cache locator in front of Numba's own ones for source files inside the
stepnet package (files elsewhere keep Numba's usual locators). A ``build``
names what Numba's cache cannot see but the compiled helpers depend on
(bounds checking, the thread count, the BLAS chosen or measured,
deterministic mode, Numba's version, whether the process may use AMX), so
runs with different settings never load each other's code.

Removing the directory, even while a process runs, costs a recompile and
nothing else: Numba recreates a locator's directory before each save. A file
in it that cannot be read (corrupted, half-written) is a cache miss: Numba's
index and data readers are wrapped so that, for files under this directory
only, a failure to unpickle means "compile again" rather than an error. A
data file written here ends with a digest of its contents, checked before it
is unpickled: damaged machine code that still unpickles is a miss too, not
code run (Numba's own files elsewhere are left as Numba writes them).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from pathlib import Path

import numba
from numba import config as numba_config
from numba.core import caching

try:
    import fcntl
except ImportError:  # (no POSIX locks: saves as Numba's own)
    fcntl = None

from ..config import config

_PACKAGE = Path(__file__).resolve().parent.parent  # the stepnet package directory
# public names since Numba 0.61, private before
_CACHE_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl
_USER_WIDE_LOCATOR = (getattr(caching, "UserWideCacheLocator", None)
                      or caching._UserWideCacheLocator)
_IN_TREE_LOCATOR = getattr(caching, "InTreeCacheLocator", None) or caching._InTreeCacheLocator


def cache_dir() -> Path:
    """The root of everything stepnet writes: ``STEPNET_CACHE_DIR`` or the
    per-user cache directory."""
    return config.cache_dir


_CHOSEN_BLAS = []  # the BLAS stepnet.jit.blas chose (measured, or STEPNET_BLAS), once it has


def note_blas(name) -> None:
    """Called by :mod:`stepnet.jit.blas` once it has chosen its BLAS, before
    it defines the helpers that call it: their compiled code is kept apart
    per choice. (Two processes measuring at once on a machine where the
    libraries are close can choose differently; a helper compiled against
    one library's symbols and loaded where the other was chosen would crash.)"""
    _CHOSEN_BLAS[:] = [name]


def build_key() -> str:
    """The settings baked into compiled helpers that Numba's cache does not key
    by (see the module docstring)."""
    # (the library chosen, not the one ``STEPNET_BLAS`` asked for: helpers
    # compiled before the choice call no library, and a library asked for
    # calls the same code as the same library measured)
    settings = [
        f"numba={numba.__version__}",
        f"boundscheck={bool(numba_config.BOUNDSCHECK)}",
        f"threads={int(numba_config.NUMBA_NUM_THREADS)}",
        f"chosen={''.join(_CHOSEN_BLAS)}",
        f"deterministic={config.engine('deterministic')}",
    ]
    from .own_loop import compiled_features  # (it imports this module)

    # (the tiles' code apart from the code of a process on the same CPU that Linux refused them)
    settings += sorted(f for f in compiled_features() if f.startswith("amx"))
    return hashlib.sha256(";".join(settings).encode()).hexdigest()[:16]


@functools.cache
def helpers_fingerprint() -> str:
    """A hash of the helper sources the generated kernels call: a kernel cached
    on disk embeds their compiled code, so a changed helper (a new stepnet)
    must give the kernel a new key."""
    return hashlib.sha256((build_key() + _helpers_stamp()).encode()).hexdigest()[:16]


def _helper_sources():
    """The source files of the compiled helpers (stepnet.jit): one calls
    another's (blas calls threads' and atomics'), and Numba's cache of one
    embeds the others' code."""
    return sorted((_PACKAGE / "jit").glob("*.py"))


@functools.cache
def _helpers_stamp():
    """A hash of the helper sources (read once): copies of the same sources
    share their compiled code (by modification times, each copy recompiled
    every helper over the other's)."""
    return hashlib.sha256(b"".join(p.name.encode() + b"\0" + p.read_bytes()
                                   for p in _helper_sources())).hexdigest()


class _ReadOnlyTaken:
    """A locator that takes a folder it cannot write to (a deployment's,
    filled ahead by ``stepnet compile``): its files are loaded, and what is
    compiled anew runs without being saved (``_unsaved``), where Numba would
    look for another folder and compile everything again."""

    def ensure_cache_path(self):
        path = self.get_cache_path()
        if not (os.path.isdir(path) and not os.access(path, os.W_OK)):
            super().ensure_cache_path()


class _KernelCacheLocator(_ReadOnlyTaken, _IN_TREE_LOCATOR):
    """Numba's cache of a generated kernel: its ``__pycache__`` beside it."""

    @classmethod
    def from_function(cls, py_func, py_file):
        return super().from_function(py_func, py_file) if _ours(py_file) else None


class _PackageCacheLocator(_ReadOnlyTaken, caching._SourceFileBackedLocatorMixin,
                           caching._CacheLocator):
    """Numba's cache of functions defined in stepnet's own source files, kept
    under ``cache_dir()/numba/<build>/`` instead of the package's __pycache__."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        relative = Path(py_file).resolve().parent.relative_to(_PACKAGE)
        self._cache_path = str(cache_dir() / "numba" / build_key() / relative)

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        # Numba's stamp is the function's own file; a helper embeds the code
        # of helpers in the other files, so any of them changing is a miss
        return _helpers_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            Path(py_file).resolve().relative_to(_PACKAGE)
        except ValueError:
            return None  # not stepnet's: Numba's own locators decide
        # an unwritable cache directory: Numba's per-user cache, never the package
        return (super().from_function(py_func, py_file)
                or _USER_WIDE_LOCATOR.from_function(py_func, py_file))


def _ours(path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(cache_dir().resolve())
    except OSError:
        return False


def _tolerant(method, miss):
    """``method`` of Numba's cache or cache file, with any failure to read a
    file under stepnet's cache directory (a corrupted or half-written index
    or data file) taken as a cache miss: Numba then compiles and writes it anew."""

    @functools.wraps(method)
    def read(self, *args):
        try:
            return method(self, *args)
        except Exception:  # noqa: BLE001  (unpickling a damaged file raises anything)
            if not _ours(self._cache_path):
                raise
            return miss()

    read.stepnet_tolerant = True
    return read


def _unsaved(save):
    """Numba's ``save_overload``: under stepnet's cache, a file that cannot be
    written (a read-only folder) leaves the code compiled for this process."""

    @functools.wraps(save)
    def save_overload(self, sig, data):
        try:
            save(self, sig, data)
        except OSError:
            if not _ours(self._cache_path):
                raise

    save_overload.stepnet_unsaved = True
    return save_overload


def _locked(save):
    """Numba's ``IndexDataCacheFile.save`` holding its folder's lock under
    stepnet's cache: it reads an index, adds to it and writes it whole, so two
    processes saving one function's signatures at once (the compile worker and
    its caller) would keep one."""

    @functools.wraps(save)
    def locked_save(self, key, data):
        if fcntl is None or not _ours(self._cache_path):
            return save(self, key, data)
        with open(os.path.join(self._cache_path, "save.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (released as the file closes)
            return save(self, key, data)

    locked_save.stepnet_locked = True
    return locked_save


def _missing_data():
    raise OSError("unreadable cache data")  # IndexDataCacheFile.load: a miss


_DIGEST = 32  # bytes of the digest that ends a data file (pickle ignores what follows its end)


def _digest(data) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def _sealed(dump):
    """Numba's ``_dump`` with a digest after the pickle, under stepnet's cache."""

    @functools.wraps(dump)
    def seal(self, obj):
        data = dump(self, obj)
        return data + _digest(data) if _ours(self._cache_path) else data

    seal.stepnet_sealed = True
    return seal


def _checked(load):
    """Numba's ``_load_data`` checking the digest first, under stepnet's cache."""

    @functools.wraps(load)
    def load_data(self, name):
        if not _ours(self._cache_path):
            return load(self, name)
        with open(self._data_path(name), "rb") as f:
            data = f.read()
        if len(data) <= _DIGEST or _digest(data[:-_DIGEST]) != data[-_DIGEST:]:
            raise OSError("damaged cache data")  # (a miss: _tolerant)
        return pickle.loads(data[:-_DIGEST])

    return load_data


def _install():
    locators = _CACHE_IMPL._locator_classes
    if _PackageCacheLocator not in locators:
        locators[:0] = [_PackageCacheLocator, _KernelCacheLocator]
    if not getattr(caching.Cache.save_overload, "stepnet_unsaved", False):
        caching.Cache.save_overload = _unsaved(caching.Cache.save_overload)
    files = caching.IndexDataCacheFile
    if not getattr(files.save, "stepnet_locked", False):
        files.save = _locked(files.save)
    if not getattr(files._dump, "stepnet_sealed", False):
        files._dump = _sealed(files._dump)
        files._load_data = _checked(files._load_data)
    if not getattr(files._load_index, "stepnet_tolerant", False):
        files._load_index = _tolerant(files._load_index, dict)
        files._load_data = _tolerant(files._load_data, _missing_data)
        # (a data file that unpickles but whose LLVM bitcode is damaged fails
        # when Numba rebuilds the code from it: a miss too, compiled anew)
        caching.Cache._load_overload = _tolerant(caching.Cache._load_overload, lambda: None)


_install()
