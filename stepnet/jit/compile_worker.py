"""The compile worker: one process per ``STEPNET_CACHE_DIR`` that compiles
new kernels into the disk cache for every stepnet process using that
directory (``python -m stepnet.jit.compile_worker``). What it is for, its
priority and when it ends: docs/internals.md (*One compile worker per
cache directory*).

- **One at a time**: a lock on ``compile_worker.lock`` in the cache
  directory; a second worker finds it taken and exits.
- **A socket** (``compile_worker.sock`` there, or in the temporary directory
  where that path is too long), one JSON line a request: ``key``, the kernel
  module's ``module`` name and ``path``, the ``function`` of it to compile
  (``program``, or an ONNX session's ``fused`` loop), the ``blas`` and
  ``build`` it was generated for, and ``signature``, its argument types
  pickled and base64-encoded; or, with ``function`` ``transposed_products``
  and a ``dtype``, the weight gradients' product
  (``transposed.prepare_transposed_products``). The answer, to every process
  that asked for the key: ``{"key": ..., "ok": true}`` or ``{"key": ...,
  "error": "..."}``; a compiled kernel is marked ready in the cache
  (``stepnet_kernel_<key>.ready``).
- **What it is doing**: ``compile_worker.json`` in the cache directory
  (:func:`status`, which ``stepnet info`` prints).
"""

from __future__ import annotations

import atexit
import base64
import collections
import contextlib
import hashlib
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# seconds the worker stays after its queue empties
IDLE_SECONDS = 5.0
# how much lower than its starter's the worker's priority is (``nice``)
NICENESS = 10
# seconds a process waits for a worker it started to listen
START_SECONDS = 60.0
# compiled after the kernels processes wait for: the executor's loop (once per
# install and dtype, about 12 s) serves only while kernels compile
LATER = ("steps_loop",)

PACKAGE_FOLDER = str(Path(__file__).resolve().parents[2])  # (holding the stepnet package)
_LOCK_NAME = "compile_worker.lock"
_STATUS_NAME = "compile_worker.json"


def socket_path(root) -> str:
    """Where the worker of cache directory ``root`` listens."""
    path = os.path.join(os.path.abspath(root), "compile_worker.sock")
    if len(path.encode()) < 100:  # (a Unix socket's path is limited to about 107 bytes)
        return path
    digest = hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"stepnet-{os.getuid()}-{digest}.sock")


def status(root) -> dict | None:
    """What the worker of cache directory ``root`` is doing: ``{"pid": ...,
    "stepnet": the folder of the stepnet it runs, "compiling": {...} or None,
    "queued": [...]}``, each kernel as its ``key`` and ``what`` (the function
    and module compiled); None when no worker runs."""
    try:
        found = json.loads((Path(root) / _STATUS_NAME).read_text())
        os.kill(found["pid"], 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found


# ----------------------------------------------------------------------------
# the worker process


def compile_kernel(request) -> None:
    # (numba_cpu, imported, sets LLVM's vectorizer limits)
    from stepnet.jit import (blas, cache, loading, numba_cpu, product_timing,  # noqa: F401
                             threads, transposed)

    if blas.SIGNATURE != request["blas"]:  # the kernel would call another library
        raise RuntimeError(f"this worker uses {blas.SIGNATURE}, the kernel {request['blas']}")
    if request.get("build", cache.helpers_fingerprint()) != cache.helpers_fingerprint():
        raise RuntimeError("this worker runs with other settings (threads, bounds checking or "
                           "deterministic mode) or another stepnet than the kernel's")
    if request.get("function") == "transposed_products":  # not a kernel: the weight
        transposed.prepare_transposed_products(request["dtype"])  # gradients' product
        return
    path = request["path"]
    module = loading.import_file(request["module"], path)
    loading.link_helpers(module)
    name = request.get("function", "program")
    getattr(module, name).compile(pickle.loads(base64.b64decode(request["signature"])))
    if name == "program":  # (a step-net's kernel: not a loop of the executor or of ONNX)
        threads.compile_helpers()  # (those Python calls too, not compiled with the kernel)
        # measured here, not in the first compiled call (float64's too for a float64 kernel)
        product_timing.small_rows_table(float64=request.get("float64", False))
    try:  # the mark loading.ready_marker names: a later process loads the kernel at once
        Path(path).with_suffix(".ready").touch()
    except OSError:
        pass


def _what(request) -> str:
    if request.get("function") == "transposed_products":
        return f"the weight gradients' product ({request.get('dtype')})"
    return f"{request.get('function', 'program')} of {request.get('path', '?')}"


class _Server:
    """The worker's queue and connections."""

    def __init__(self, root: Path, listener: socket.socket):
        self.root = root
        self.listener = listener
        self.cond = threading.Condition()
        self.queue = collections.OrderedDict()  # key -> (request, [connections waiting])
        self.current = None  # (key, request, [connections waiting]) being compiled
        self.closing = False
        self.idle_since = time.monotonic()

    def serve(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()
        while True:
            with self.cond:
                while not self.queue:
                    self._write_status()
                    left = self.idle_since + IDLE_SECONDS - time.monotonic()
                    if left <= 0:
                        self.closing = True
                        return
                    self.cond.wait(left)
                # what running processes wait for first, then what ended ones asked (LATER last)
                waited = [k for k, (_, waiting) in self.queue.items() if waiting] or list(self.queue)
                key = next((k for k in waited if self.queue[k][0].get("function") not in LATER), waited[0])
                request, waiting = self.queue.pop(key)
                self.current = (key, request, waiting)
                self._write_status()
            try:
                compile_kernel(request)
                reply = {"key": key, "ok": True}
            except Exception as exc:  # noqa: BLE001  (reported to the processes that asked)
                reply = {"key": key, "error": f"{type(exc).__name__}: {exc}"}
            with self.cond:
                self.current = None
                self.idle_since = time.monotonic()
                for connection in waiting:
                    connection.send(reply)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            connection = _Connection(sock)
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection) -> None:
        connection.send({"worker": os.getpid()})
        for request in connection.lines():
            with self.cond:
                if self.closing:
                    break  # (the process sends it to the next worker)
                key = request["key"]
                if self.current is not None and self.current[0] == key:
                    self.current[2].append(connection)
                elif key in self.queue:
                    self.queue[key][1].append(connection)
                else:
                    self.queue[key] = (request, [connection])
                    self._write_status()
                self.cond.notify()
        with self.cond:  # that process has ended: what it asked for waits behind the others'
            for _, waiting in self.queue.values():
                waiting[:] = [c for c in waiting if c is not connection]

    def _write_status(self) -> None:
        found = {"pid": os.getpid(), "stepnet": PACKAGE_FOLDER,
                 "compiling": None if self.current is None else
                 {"key": self.current[0], "what": _what(self.current[1])},
                 "queued": [{"key": key, "what": _what(request)}
                            for key, (request, _) in self.queue.items()]}
        tmp = self.root / f"{_STATUS_NAME}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(found))
            os.replace(tmp, self.root / _STATUS_NAME)
        except OSError:  # a removed cache directory: nothing to tell
            pass


class _Connection:
    """A socket read and written one JSON line at a time."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.file = sock.makefile("r", encoding="utf-8")
        self.lock = threading.Lock()

    def lines(self):
        try:
            for line in self.file:
                yield json.loads(line)
        except (OSError, ValueError):
            return

    def send(self, message) -> bool:
        try:
            with self.lock:
                self.sock.sendall((json.dumps(message) + "\n").encode())
            return True
        except OSError:
            return False


def main() -> int:
    import fcntl

    root = Path(_default_root())
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / _LOCK_NAME, "a")  # noqa: SIM115  (held for the process's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another worker serves this directory
        return 0
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    path = socket_path(root)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # (a socket left by a worker that was killed)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    server = _Server(root, listener)
    try:
        server.serve()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            (root / _STATUS_NAME).unlink()
        listener.close()
    # (daemon threads may be blocked reading: end without waiting for them)
    sys.stdout.flush()
    os._exit(0)


def _default_root() -> str:
    from stepnet.jit.cache import cache_dir

    return str(cache_dir())


# ----------------------------------------------------------------------------
# the client, in each stepnet process


class Client:
    """This process's connection to the worker of cache directory ``root``,
    and its requests not answered yet. Connecting (and starting the worker
    if none runs) happens on a thread of its own, so a first call answers on
    the interpreter without waiting for the worker to start; requests made
    meanwhile are sent once it listens."""

    def __init__(self, root):
        self.root = Path(root)
        self.lock = threading.Lock()
        self.pending = {}  # key -> (request, callbacks taking an error or None)
        self.closed = False  # the worker has ended, or never started
        self._connection = None
        self._pid = None
        self._connected = threading.Event()
        threading.Thread(target=self._run, name="stepnet-compile-worker", daemon=True).start()

    def pid(self, timeout=None):
        """The worker's process id, once connected (None if it did not start
        within ``timeout`` seconds)."""
        self._connected.wait(timeout)
        return self._pid

    def submit(self, kernel, signature, callback, function="program"):
        """Compile ``kernel.module``'s ``function`` for ``signature``; then
        ``callback(error or None)``, on another thread."""
        from . import blas

        self.send({"key": kernel.key, "module": kernel.module.__name__,
                   "path": kernel.module.__file__, "function": function, "blas": blas.SIGNATURE,
                   "float64": getattr(kernel, "float64", False),  # (NumbaProgram.float64)
                   "signature": base64.b64encode(pickle.dumps(signature)).decode()}, callback)

    def send(self, request, callback):
        """Send ``request`` (a kernel's, or another job of the worker) unless
        this process has one with its key pending; then ``callback(error or
        None)``, on another thread."""
        from .cache import helpers_fingerprint  # (the settings and the helpers' sources)

        request = dict(request, build=helpers_fingerprint())
        with self.lock:
            first = request["key"] not in self.pending
            self.pending.setdefault(request["key"], (request, []))[1].append(callback)
            connection, closed = self._connection, self.closed
        if closed:
            self._resend()
        elif first and connection is not None:
            connection.send(request)  # (if the worker has just ended: _run resends it)

    def _run(self):
        try:
            connection = _connect(self.root)
            hello = next(connection.lines(), None)
            if not hello or "worker" not in hello:
                raise OSError("the compile worker did not answer")
        except OSError as exc:
            with self.lock:
                self.closed = True
                pending, self.pending = self.pending, {}
            self._connected.set()
            for _, callbacks in pending.values():
                for callback in callbacks:
                    callback(f"the compile worker did not start: {exc}")
            return
        with self.lock:
            self._connection, self._pid = connection, hello["worker"]
            waiting = [request for request, _ in self.pending.values()]
        for request in waiting:  # (before _connected: _sent_at_exit waits for that)
            connection.send(request)
        self._connected.set()
        for reply in connection.lines():
            with self.lock:
                _, callbacks = self.pending.pop(reply.get("key"), (None, []))
            for callback in callbacks:
                callback(reply.get("error"))
        with self.lock:
            self.closed = True
        self._resend()

    def _resend(self):
        """The worker has ended (idle, or killed) with requests unanswered:
        send them to the next one."""
        with self.lock:
            pending, self.pending = self.pending, {}
        if pending:
            successor = worker(self.root)
            for request, callbacks in pending.values():
                for callback in callbacks:
                    successor.send(request, callback)


def _connect(root: Path) -> _Connection:
    """A connection to the worker of ``root``, started if none listens."""
    if os.name != "posix" or not hasattr(socket, "AF_UNIX"):
        raise OSError("the compile worker needs Unix sockets")
    path = socket_path(root)
    deadline = time.monotonic() + START_SECONDS
    started = None
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return _Connection(sock)
        except OSError:
            sock.close()
        if time.monotonic() > deadline:
            raise OSError(f"the compile worker did not listen on {path} in {START_SECONDS:.0f} s")
        if started is not None and started.poll() not in (None, 0):
            raise OSError(f"the compile worker exited with status {started.returncode}")
        if started is None or started.poll() is not None:
            # none listens, and none this process started is starting: start
            # one (one started while another holds the directory's lock exits
            # at once, and this connects to the other)
            root.mkdir(parents=True, exist_ok=True)
            # (no output inherited: a caller reading this one's to its end must
            # not wait for the worker; in the folder of this stepnet, which ``-m``
            # imports first: a worker on another copy fills caches never hit here)
            started = subprocess.Popen(  # (reaped by worker() when it has ended)
                [sys.executable, "-m", "stepnet.jit.compile_worker"], cwd=PACKAGE_FOLDER,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=dict(os.environ, STEPNET_CACHE_DIR=str(root)), start_new_session=True)
            _STARTED.append(started)
        time.sleep(0.05)


_CLIENTS = {}
_CLIENTS_LOCK = threading.Lock()
_STARTED = []  # the workers this process started


@atexit.register
def _sent_at_exit():
    """At the end of this process, wait for a worker it is starting to listen,
    and for the requests made meanwhile to be sent (not compiled): a first
    run's kernels are then in the cache for the next run."""
    for client in list(_CLIENTS.values()):
        if client.pending and not client.closed:
            client._connected.wait(START_SECONDS)


def _after_fork_in_child():
    # the parent's connections and the threads reading their replies are not
    # in this process: it connects again (its own requests, its own answers)
    global _CLIENTS_LOCK
    _CLIENTS.clear()
    _STARTED.clear()
    _CLIENTS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def worker(root) -> Client:
    """This process's client of the compile worker of cache directory
    ``root`` (connected, the worker started, on first use)."""
    root = Path(root).resolve()  # (the worker runs in another folder)
    with _CLIENTS_LOCK:
        _STARTED[:] = [p for p in _STARTED if p.poll() is None]
        client = _CLIENTS.get(root)
        if client is None or client.closed:
            client = _CLIENTS[root] = Client(root)
        return client


if __name__ == "__main__":
    sys.exit(main())
