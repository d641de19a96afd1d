"""A call of a compiled CUDA program (:mod:`stepnet.jit.numba_cuda` writes its
kernels): the call's sequences sorted and each step's rows packed
(:class:`_Batch`), its inputs, memories and outputs on the device, the
hoisted kernels and then the time loop (one persistent kernel, or each
step's kernels), and the outputs back in the caller's layout.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import numpy as np

from .. import ir, registry
from ..errors import LoDError, ShapeError, UnsupportedError
from ..lod import LoDTensor, device_array, host_array

try:  # numba.cuda imports without a GPU; is_available() says whether one (or the simulator) is there
    from numba import cuda
except ImportError:  # pragma: no cover - numba always ships cuda
    cuda = None


def _simulator() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


# num_seq * widest step value up to which the whole loop is one persistent
# kernel; above it a stage has enough work for the GPU's threads that a
# launch per stage and step costs less than looping on one block per
# multiprocessor (where measured, the persistent kernel was clearly faster
# below this bound and slower well above it: docs/cuda.md, *The persistent
# kernel's bound*)
PERSISTENT_MAX_ELEMENTS = 1 << 17
# threads per block of a stage kernel, and of a persistent kernel over few
# elements; one warp on Numba's CUDA simulator, whose threads are Python
# threads that every cuda.syncthreads() waits for (the kernels loop over
# whatever a block's threads do not cover, so the code run is the same)
THREADS = 32 if _simulator() else 128
# threads per block of a persistent kernel over more elements than one block of
# THREADS per multiprocessor takes: 256 threads of at most 255 registers each
# fit one block on a multiprocessor (64K registers), as the cooperative launch
# needs
PERSISTENT_THREADS = 256
# multiply-adds a step (every row, every step GEMM) up to which the loop runs
# on one block, its stages separated by cuda.syncthreads() rather than
# grid-wide syncs, provided the step GEMMs' weights fit that block's shared
# memory (W3's 49K a step run faster so than on three blocks with grid-wide
# syncs: docs/cuda.md)
BLOCK_MAX_MACS = 1 << 19
BLOCK_MAX_THREADS = 1024
# dynamic shared memory a block may have without the kernel's opt-in
# attribute (CUDA's default limit)
SHARED_DEFAULT = 48 * 1024
# a hoisted GEMM's tile: TILE x TILE outputs a block of (TILE / 4)^2 threads,
# 4 x 4 a thread, over slices of TILE_K columns of ``a`` in shared memory
TILE, TILE_K = 64, 16
MAX_GRID_Y = 65535  # (CUDA's limit on a grid's blocks down)
# a step GEMM's products written out a chunk at a time in the loop kernel
# (written out in full they were faster and took many times as long to
# compile: docs/cuda.md, *The products written out*)
UNROLL = 16


@dataclass
class LoopPlan:
    """How a call's time loop runs, decided in one place (``_Run.plan``):
    ``driver`` is "block" (one block, ``cuda.syncthreads()`` between
    stages), "persistent" (a cooperative grid, a grid-wide sync between
    stages) or "per-stage" (a launch per stage and step); ``resident``: each
    block's slice of the step GEMMs' weights is copied to its shared memory
    (``shared_bytes`` a block) once a call and read there at every step. On a
    GPU, ``threads`` is lowered at launch to what the compiled kernel's
    registers allow a block."""

    driver: str
    blocks: int
    threads: int
    resident: bool
    shared_bytes: int
    why: str


@dataclass
class CallCounts:
    """What a call did, counted as it ran (``compiled.last_call``): kernel
    launches, host-to-device copies, the syncs between a step's stages (grid-
    wide and block-wide) and the step GEMMs' weight bytes read from global
    memory at every step after the first (zero where they are resident)."""

    plan: LoopPlan
    launches: int = 0
    copies_to_device: int = 0
    grid_syncs_per_step: int = 0
    block_syncs_per_step: int = 0
    global_weight_bytes_per_step: int = 0


def _persistent_grid(count):
    """(blocks, threads per block) of the persistent kernel over ``count``
    elements a stage: all blocks must be resident at once for its grid-wide
    sync (a cooperative launch), so at most one per multiprocessor, of
    ``PERSISTENT_THREADS`` where blocks of ``THREADS`` would loop; the
    simulator syncs a grid of one block only."""
    if _simulator():
        return 1, THREADS
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    threads = THREADS if count <= sms * THREADS else PERSISTENT_THREADS
    return max(1, min(sms, (count + threads - 1) // threads)), threads


def _shared_limit() -> int:
    """Dynamic shared memory a block of a loop kernel may have: the device's
    opt-in limit where numba-cuda's driver binding can raise a kernel's (the
    attribute numba-cuda issue 94 asks for), else CUDA's default 48 KB."""
    if _simulator() or _set_attribute() is None:
        return SHARED_DEFAULT
    device = cuda.get_current_device()
    return int(getattr(device, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", SHARED_DEFAULT))


@functools.cache
def _set_attribute():
    """numba-cuda's ``cuKernelSetAttribute`` and the attribute's enum, or None
    where this numba-cuda has no such binding (older versions, numba's own
    ``numba.cuda``)."""
    try:
        from cuda.bindings import driver as binding
        from numba.cuda.cudadrv.driver import driver
    except ImportError:
        return None
    setter = getattr(driver, "cuKernelSetAttribute", None)
    attr = getattr(getattr(binding, "CUfunction_attribute", None),
                   "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", None)
    return None if setter is None or attr is None else (setter, attr)


def _opt_in(spec, nbytes):
    """Allow the compiled kernel ``spec`` ``nbytes`` of dynamic shared memory a
    block."""
    (compiled,) = spec.overloads.values()
    function = compiled.library.get_cufunc()
    setter, attr = _set_attribute()
    setter(attr, nbytes, function.handle, function.device.id)


def _host(a):
    return np.ascontiguousarray(a)


def _launch(kernel, count, *args):
    if count <= 0:
        return
    blocks = (count + THREADS - 1) // THREADS
    kernel[blocks, THREADS](*args)


class _Run:
    """``run(args, consts)``: one call of the compiled program."""

    def __init__(self, program, kernels, namespace):
        self.program, self.k, self.ns = program, kernels, namespace
        # (kernel, width, the names of the arrays it takes, whether a tiled
        # GEMM) of the stages before the loop, and (kernel, width, space,
        # names) of those of each step (the per-stage path)
        self.hoisted = [(namespace[n], w, used, tiled) for g, n, w, _, used, tiled
                        in kernels.kernel_names if g == "hoisted"]
        self.stepped = [(namespace[n], w, space, used) for g, n, w, space, used, _
                        in kernels.kernel_names if g == "step"]
        self.last_call = None  # the CallCounts of the last call
        # device arrays kept from call to call (reused while their shape
        # holds: numba-cuda allocates each with the driver), the pinned host
        # buffer of the upload, and the lock that keeps two calls apart
        self._kept = {}
        self._views = {}  # name -> (where it lies in the upload, the upload, its view)
        self._staging = None
        self._lock = threading.Lock()
        # loop kernel's name -> (its specialization, the shared bytes it may
        # have, the threads a block of it may have)
        self._opted_in = {}

    def __call__(self, args, consts, scopes=None):
        if scopes is not None:
            raise UnsupportedError("cuda backend: keep_scopes=True needs backend='interpreter'")
        batch = _Batch(self.program, self.k, args, consts)
        with self._lock:
            self.last_call = CallCounts(self.plan(batch))
            if batch.steps == 0:  # no step to run: empty all-steps outputs, initial states
                found = _no_steps(batch.eqn, self.k.body, batch.initial, batch.seq_args,
                                  batch.num_seq, batch.ragged_args)
                return [_to_device(v) for v in found] if batch.on_device else found
            device = self._inputs(batch, consts)
            self._run(batch, device)
            return self._outputs(batch, device)

    def _empty(self, name, shape, dtype):
        """A device array for ``name`` of this call, the last call's where it
        has the same shape and dtype."""
        a = self._kept.get(name)
        if a is None or a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
            a = self._kept[name] = cuda.device_array(shape, dtype)
        return a

    def _copy(self, device, host):
        self.last_call.copies_to_device += 1
        device.copy_to_device(host)

    def _launch(self, kernel, count, *args):
        self.last_call.launches += count > 0
        _launch(kernel, count, *args)

    def _inputs(self, b, consts):
        """``{name: device array}``: the call's inputs laid out as the kernels
        read them (rows in sorted sequence order, each step's rows packed),
        its memories and outputs started, the buffers and constants, all
        copied to the device in one copy (:meth:`_upload`)."""
        k, body = self.k, self.k.body
        device = {}
        for i, X in enumerate(b.seq_args):
            if X.num_levels == 1:
                device[f"seq{i}"] = _rows_in_place(X, b.seq_names[i]) if X.on_device else \
                    _host(X.data.reshape(len(X.data), -1))
            elif X.on_device:
                raise UnsupportedError(f"cuda backend: input {b.seq_names[i]} has nested sequences "
                                       f"on the GPU (their inner step-nets read host rows); pass "
                                       f"{b.seq_names[i]}.to_host()")
            else:  # read by nested step-nets only: not on the device as rows
                device[f"seq{i}"] = cuda.device_array((1, 1), np.float32)
        position = {id(v): i for i, v in enumerate(body.step_inputs)}
        for n, (e, inner) in enumerate(k.nested):
            inner_args = [LoDTensor(b.seq_args[position[id(v)]].data,
                                    b.seq_args[position[id(v)]].levels[1:])
                          for v in ir.rnn_parts(e)[0]]
            for j, (o, value) in enumerate(zip(e.outputs, inner(inner_args, consts))):
                # one row per sub-sequence = per token of this net, packed like its step inputs
                rows = np.asarray(value, o.dtype).reshape(len(value), -1)
                device[f"nest{n}_{j}"] = _host(rows[b.gather])
        for i, v in enumerate(b.statics):
            if i in k.ragged:
                data = np.asarray(b.by_var[id(v)].data)
                device[f"static{i}"] = _host(data[b.ragged.pack].reshape(b.ragged.rows, -1))
                continue
            device[f"static{i}"] = _host(np.asarray(b.by_var[id(v)])[b.order]
                                           .reshape(b.num_seq, -1))
        if b.ragged is not None:
            device["mstart"], device["row_of"] = _host(b.ragged.mstart), _host(b.ragged.row_of)
        mem_init = self._memories(b, device)
        for kk, (out, all_steps) in enumerate(zip(body.outputs, b.eqn.attrs["all_steps"])):
            width = k.values[id(out)].width
            if not all_steps and b.eqn.attrs["output_memory"][kk] in k.ragged_memories:
                device[f"out{kk}"] = cuda.device_array((1, 1), out.dtype)  # the memory's buffer is it
                continue
            if all_steps:
                rows = int(b.moffs[-1]) if out.lod_depth else b.total
                # (given back on the device: the caller's own array, never the next call's)
                device[f"out{kk}"] = cuda.device_array((max(rows, 1), width), out.dtype) \
                    if b.on_device else self._empty(f"out{kk}", (max(rows, 1), width), out.dtype)
            else:
                mi = b.eqn.attrs["output_memory"][kk]
                start = mem_init[mi][b.order] if mi >= 0 else \
                    np.zeros((b.num_seq,) + out.shape[1:], out.dtype)
                device[f"out{kk}"] = _host(np.asarray(start, out.dtype).reshape(b.num_seq, -1))
        for name, kind, width, dtype in k.buffers:
            rows = {"token": b.total, "mrow": b.ragged.rows if b.ragged else 0}.get(kind, b.num_seq)
            device[name] = self._empty(name, (max(rows, 1), width), dtype)
        for e in k.host_eqns:
            vals = [b.const_env[id(v)] if isinstance(v, ir.Var) else v.value for v in e.inputs]
            b.const_env[id(e.outputs[0])] = registry.get(e.op).numpy(*vals, **e.attrs)
        for name, weights in k.joined:
            device[name] = _host(np.concatenate([b.const_env[id(w)] for w in weights], axis=1)
                                   .ravel())
        needed = set(k.used_names)
        for v_id, info in k.values.items():
            if info.kind == "const" and info.name in needed and info.name not in device:
                device[info.name] = _host(np.ravel(np.asarray(b.const_env[v_id], info.dtype)))
        device["steps"] = _host(np.stack([b.nbs, b.offs, b.moffs[:b.steps]]))
        device["tok"] = b.gather  # the caller's token of each packed row
        if b.on_device:  # (each sequence's row of a last-step output, scattered on the device)
            device["out_order"] = _host(b.order)
        return self._upload(device)

    def _upload(self, device):
        """The host arrays of ``device`` packed into one buffer (each at a
        multiple of 256 bytes), copied to the device at once, and replaced by
        views of it (numba-cuda spends more on each copy's call than on the
        bytes of such small arrays)."""
        host = {name: a for name, a in device.items() if isinstance(a, np.ndarray)}
        starts, size = {}, 0
        for name, a in host.items():
            starts[name] = size
            size += -(-max(a.nbytes, 1) // 256) * 256
        if self._staging is None or self._staging.size < size:  # grown, never shrunk
            grown = max(size, 0 if self._staging is None else self._staging.size * 3 // 2)
            self._staging = cuda.pinned_array(grown, np.uint8)
        buffer = self._staging[:size]
        for name, a in host.items():
            buffer[starts[name]:starts[name] + a.nbytes] = a.reshape(-1).view(np.uint8)
        upload = self._empty("upload", (self._staging.size,), np.uint8)
        self._copy(upload[:size], buffer)
        for name, a in host.items():
            # (a view is a Python object numba-cuda takes tens of microseconds
            # to make: the last call's is kept while it would be the same)
            key = (starts[name], a.shape, a.dtype.str)
            kept = self._views.get(name)
            if kept is None or kept[0] != key or kept[1] is not upload:
                part = upload[starts[name]:starts[name] + max(a.nbytes, a.dtype.itemsize)]
                view = part.view(a.dtype)[:a.size].reshape(a.shape) if a.size else \
                    cuda.device_array(a.shape, a.dtype)
                kept = self._views[name] = (key, upload, view)
            device[name] = kept[2]
        return device

    def _memories(self, b, device):
        """The memories started on the device (a ragged one: one row per row
        of the ragged static inputs) and snapshots' buffers; the initial
        values of the others, broadcast to every sequence (None for a ragged
        one)."""
        k, body = self.k, self.k.body
        mem_init = []
        for i, (mem, v) in enumerate(zip(body.memories, b.inits)):
            if i in k.ragged_memories:
                width = k.values[id(mem.pre)].width
                device[f"mem{i}"] = _host(np.full((max(b.ragged.rows, 1), width), b.initial(v),
                                                    mem.pre.dtype))
                mem_init.append(None)
                continue
            full = np.broadcast_to(np.asarray(b.initial(v), mem.pre.dtype),
                                   (b.num_seq,) + tuple(mem.pre.shape[1:]))
            mem_init.append(full)
            device[f"mem{i}"] = _host(full[b.order].reshape(b.num_seq, -1))
        for i in k.snapshots:
            device[f"snap{i}"] = self._empty(f"snap{i}", (b.num_seq, k.values[
                id(body.memories[i].pre)].width), body.memories[i].pre.dtype)
        return mem_init

    def plan(self, b) -> LoopPlan:
        """How the time loop of batch ``b`` runs (:class:`LoopPlan`): the one
        place that decides it."""
        k = self.k
        count = b.num_seq * k.widest
        if count > PERSISTENT_MAX_ELEMENTS:
            return LoopPlan("per-stage", 0, THREADS, False, 0,
                            f"{count} elements a stage > PERSISTENT_MAX_ELEMENTS")
        gemms = k.step_gemms
        macs = b.num_seq * sum(g.K * g.N for g in gemms)
        one_type = len({g.weight_dtype for g in gemms}) == 1
        limit = _shared_limit()

        def shared(blocks):  # a block's slice of every step GEMM's weights
            itemsize = gemms[0].weight_dtype.itemsize if gemms else 0
            return sum(g.row * -(-g.N // blocks) for g in gemms) * itemsize

        if macs <= BLOCK_MAX_MACS and (not gemms or one_type and shared(1) <= limit):
            threads = THREADS if _simulator() else \
                min(BLOCK_MAX_THREADS, max(THREADS, -(-count // 32) * 32))
            driver, blocks, why = "block", 1, f"{macs} multiply-adds a step <= BLOCK_MAX_MACS"
        else:
            blocks, threads = _persistent_grid(count)
            driver, why = "persistent", f"{macs} multiply-adds a step > BLOCK_MAX_MACS" \
                if macs > BLOCK_MAX_MACS else "the step GEMMs' weights exceed one block's shared memory"
        need = shared(blocks)
        resident = bool(gemms) and one_type and need <= limit
        if gemms and not resident:
            why += f"; weights read from global memory ({need} bytes a block > {limit})"
        return LoopPlan(driver, blocks, threads, resident, need if resident else 0, why)

    def _run(self, b, device):
        """The hoisted stages' kernels over every token, then the time loop as
        its plan says (:meth:`plan`)."""
        self._hoisted(b, device)
        self._loop(b, device)

    def _hoisted(self, b, device):
        for kernel, width, names, tiled in self.hoisted:
            if tiled:  # TILE x TILE outputs a block (at most MAX_GRID_Y down: they loop)
                tiles = (-(-width // TILE), min(-(-b.total // TILE), MAX_GRID_Y))
                self.last_call.launches += 1
                kernel[tiles, (TILE // 4, TILE // 4)](b.total, 0, 0, *[device[n] for n in names])
            else:
                self._launch(kernel, b.total * width, b.total, 0, 0, *[device[n] for n in names])

    def _loop(self, b, device):
        k, counts = self.k, self.last_call
        plan, syncs = counts.plan, len(self.stepped)
        if not plan.resident:
            counts.global_weight_bytes_per_step = sum(g.weight_bytes for g in k.step_gemms)
        if plan.driver != "per-stage":
            args = (b.steps, device["steps"], int(plan.resident),
                    *[device[n] for n in k.used_names])
            kernel = self._loop_kernel(plan, args)
            kernel[plan.blocks, plan.threads, 0, plan.shared_bytes](*args)
            counts.launches += 1
            if plan.driver == "block":
                counts.block_syncs_per_step = syncs
            else:
                counts.grid_syncs_per_step = syncs
            return
        stepped = [(kernel, width, space, [device[n] for n in names])
                   for kernel, width, space, names in self.stepped]
        for t in range(b.steps):
            nb, off, moff = int(b.nbs[t]), int(b.offs[t]), int(b.moffs[t])
            for kernel, width, space, kernel_args in stepped:
                rows = b.ragged.mstart[nb] if space == "mrow" else nb
                self._launch(kernel, rows * width, nb, off, moff, *kernel_args)

    def _loop_kernel(self, plan, args):
        """The loop kernel of ``plan``'s driver, compiled for ``args``, allowed
        ``plan.shared_bytes`` of dynamic shared memory a block (above CUDA's
        default 48 KB the kernel opts in: :func:`_opt_in`); ``plan.threads``
        lowered to what the kernel's registers allow a block."""
        name = plan.driver
        kernel = self.ns[name]
        if _simulator():
            return kernel
        spec, allowed, most = self._opted_in.get(name, (None, -1, 0))
        if spec is None:
            spec = kernel.specialize(*args)
            (compiled,) = spec.overloads.values()
            most = compiled.max_threads_per_block // 32 * 32
        if allowed < plan.shared_bytes and plan.shared_bytes > SHARED_DEFAULT:
            _opt_in(spec, plan.shared_bytes)
            allowed = plan.shared_bytes
        self._opted_in[name] = (spec, allowed, most)
        plan.threads = min(plan.threads, most)
        return spec

    def _outputs(self, b, device):
        """The outputs in the caller's layout: on the device where the step
        inputs were (:meth:`_device_outputs`), else on the host."""
        return self._device_outputs(b, device) if b.on_device else self._host_outputs(b, device)

    def _host_outputs(self, b, device):
        """The outputs back on the host in the caller's layout."""
        k, body, eqn = self.k, self.k.body, b.eqn
        results = []
        for kk, (out, all_steps) in enumerate(zip(body.outputs, eqn.attrs["all_steps"])):
            mi = eqn.attrs["output_memory"][kk]
            if not all_steps and mi in k.ragged_memories:  # back to the static input's layout
                like = b.by_var[id(b.statics[k.ragged_memories[mi]])]
                data = np.empty(np.shape(like.data), out.dtype)
                data[b.ragged.pack] = device[f"mem{mi}"].copy_to_host()[:b.ragged.rows].reshape(
                    (b.ragged.rows,) + tuple(out.shape[1:]))
                results.append(LoDTensor(data, like.levels))
                continue
            host = device[f"out{kk}"].copy_to_host()
            if all_steps and out.lod_depth:  # (sequence, step, that sequence's rows)
                results.append(b.ragged.all_steps(host, out, b.nbs, b.sorted_lengths, b.order,
                                                  b.seq_args[0].levels[0], eqn.attrs["reverse"]))
            elif all_steps:  # written in the caller's rows
                data = host[:b.total].reshape((b.total,) + tuple(out.shape[1:]))
                results.append(LoDTensor(data, [b.seq_args[0].levels[0]]))
            else:
                last = np.empty((b.num_seq,) + tuple(out.shape[1:]), out.dtype)
                last[b.order] = host.reshape((b.num_seq,) + tuple(out.shape[1:]))
                results.append(last)
        return results

    def _device_outputs(self, b, device):
        """The outputs on the device in the caller's layout: an all-steps
        output is its own array (written in the caller's rows), a last-step
        one scattered from sorted order by a kernel; a ragged one (a
        memory's rows, or rows of every step) is laid out on the host and
        copied back."""
        k, body, eqn = self.k, self.k.body, b.eqn
        results = []
        for kk, (out, all_steps) in enumerate(zip(body.outputs, eqn.attrs["all_steps"])):
            shape = tuple(out.shape[1:])
            if out.lod_depth or not all_steps and eqn.attrs["output_memory"][kk] in k.ragged_memories:
                results.append(None)
            elif all_steps:
                data = device[f"out{kk}"][:b.total].reshape((b.total,) + shape)
                results.append(LoDTensor._trusted(data, [b.seq_args[0].levels[0]]))
            else:
                rows = device[f"out{kk}"]
                last = cuda.device_array(rows.shape, rows.dtype)
                self._launch(_scatter_rows(), rows.size, rows, device["out_order"], last)
                results.append(last.reshape((b.num_seq,) + shape))
        if any(r is None for r in results):
            host = self._host_outputs(b, device)
            results = [_to_device(h) if r is None else r for r, h in zip(results, host)]
        return results


def _rows_in_place(X, name):
    """A step input's rows on the device, read where they lie ``[N, width]``."""
    data = X.data
    if not data.is_c_contiguous():
        raise ShapeError(f"input {name}: its rows on the GPU are not C-contiguous; pass a "
                         f"contiguous array (torch: .contiguous(); numba: a fresh device array)")
    width = int(np.prod(data.shape[1:]))
    return data.reshape(data.shape[0], width) if data.shape[0] else \
        cuda.device_array((1, 1), data.dtype)


def _to_device(value):
    """A host result (an array or a LoDTensor) copied to the device."""
    if isinstance(value, LoDTensor):
        return LoDTensor._trusted(cuda.to_device(np.ascontiguousarray(value.data)), value.levels)
    return cuda.to_device(np.ascontiguousarray(value))


@functools.cache
def _scatter_rows():
    """A kernel: ``dst[order[r]] = src[r]`` for every row ``r`` of ``src``."""

    @cuda.jit
    def scatter(src, order, dst):
        i = cuda.grid(1)
        width = src.shape[1]
        if i < src.shape[0] * width:
            r = i // width
            dst[order[r], i - r * width] = src[r, i - r * width]

    return scatter


@functools.cache
def _reductions():
    """Kernels of a backward's weight gradients on the device: ``a.T @ b``
    (a thread an element, its row along ``b``'s columns so that a warp reads
    ``b`` coalesced and one element of ``a``) and the column sums of ``b``,
    each a sum over every token in float64."""

    @cuda.jit
    def transposed(a, b, out):
        n, m = cuda.grid(2)
        if m < out.shape[0] and n < out.shape[1]:
            acc = 0.0
            for r in range(a.shape[0]):
                acc += a[r, m] * b[r, n]
            out[m, n] = acc

    @cuda.jit
    def column_sums(b, out):
        n = cuda.grid(1)
        if n < out.shape[0]:
            acc = 0.0
            for r in range(b.shape[0]):
                acc += b[r, n]
            out[n] = acc

    return transposed, column_sums


def transposed_products(products):
    """``a.T @ b`` for each ``(a, b, column_sums)`` of ``products`` (with
    ``column_sums``: ``(a.T @ b, b.sum(0))``) where both lie on the device:
    summed over the tokens there, the result (a weight's size) copied back;
    anything else on the host, with NumPy."""
    transposed, _ = _reductions()
    results = []
    for a, b, column_sums in products:
        if device_array(a) is None or device_array(b) is None or a.ndim != 2 or b.ndim != 2 \
                or a.dtype != b.dtype:
            a, b = host_array(a), host_array(b)
            results.append((a.T @ b, b.sum(0)) if column_sums else a.T @ b)
            continue
        m, n = a.shape[1], b.shape[1]
        out = cuda.device_array((m, n), a.dtype)
        if m * n:
            transposed[(-(-n // 32), -(-m // 8)), (32, 8)](a, b, out)
        product = out.copy_to_host()
        results.append((product, column_sums_on_device(b)) if column_sums else product)
    return results


def column_sums_on_device(rows):
    """``rows.sum(0)`` of rows on the device ``[R, ...]``, summed there and
    copied back."""
    _, column_sums = _reductions()
    if not rows.shape[0]:
        return np.zeros(rows.shape[1:], rows.dtype)
    flat = rows.reshape(rows.shape[0], int(np.prod(rows.shape[1:])))
    out = cuda.device_array(flat.shape[1], flat.dtype)
    column_sums[-(-flat.shape[1] // THREADS), THREADS](flat, out)
    return out.copy_to_host().reshape(rows.shape[1:])


class _Batch:
    """A call's sequences as the kernels take them: sorted longest first
    (``order``), the active rows of each step (``nbs``) and where they start
    among the packed rows (``offs``; ``moffs`` for the ragged static inputs'
    rows), the token of each packed row (``gather``), the arguments by var."""

    def __init__(self, program, k, args, consts):
        self.eqn = program.eqn
        self.by_var = {id(v): a for v, a in zip(program.inputs, args)}
        seqs, self.statics, self.inits = (list(p) for p in ir.rnn_parts(self.eqn))
        self.seq_args = [self.by_var[id(v)] for v in seqs]
        self.seq_names = [v.name for v in seqs]
        # (the step inputs on the device: the outputs stay there too)
        self.on_device = any(X.on_device for X in self.seq_args)
        lengths = np.diff(np.asarray(self.seq_args[0].levels[0])).astype(np.int64)
        self.num_seq = len(lengths)
        self.order = np.argsort(-lengths, kind="stable")
        self.sorted_lengths = lengths[self.order]
        self.steps = steps = int(self.sorted_lengths[0]) if self.num_seq else 0
        # sequences still running at step t: those longer than t
        ended = np.cumsum(np.bincount(lengths, minlength=steps + 1))[:steps]
        self.nbs = (self.num_seq - ended).astype(np.int64)
        self.offs = np.concatenate([[0], np.cumsum(self.nbs)[:-1]]).astype(np.int64) if steps \
            else self.nbs
        self.total = int(lengths.sum())
        self.const_env = {id(v): np.asarray(consts[v]) for v in program.consts}
        self.ragged_args = [self.by_var[id(self.statics[i])] for i in k.ragged]
        if steps == 0:
            return
        self.ragged = _RaggedRows(self.ragged_args, [self.statics[i].name for i in k.ragged],
                                  self.order) if k.ragged else None
        self.moffs = self.ragged.step_offsets(self.nbs) if self.ragged else \
            np.zeros(steps + 1, np.int64)
        # packed row r (step t, sorted position b) holds token starts[order[b]] + position
        starts = np.asarray(self.seq_args[0].levels[0][:-1])[self.order]
        t = np.repeat(np.arange(steps), self.nbs)
        b = np.arange(self.total) - np.repeat(self.offs, self.nbs)
        pos = self.sorted_lengths[b] - 1 - t if self.eqn.attrs["reverse"] else t
        self.gather = (starts[b] + pos).astype(np.int64)

    def initial(self, v):
        """A memory's init: bound by name, a literal or a constant."""
        if isinstance(v, ir.Literal):
            return v.value
        return self.by_var[id(v)] if id(v) in self.by_var else self.const_env[id(v)]


class _RaggedRows:
    """The rows of the ragged static inputs (one LoD for all), packed in
    sorted sequence order: sequence b's rows are ``mstart[b]`` to
    ``mstart[b + 1]``, row r belongs to ``row_of[r]``; ``pack`` maps packed
    rows to the inputs' own rows."""

    def __init__(self, statics, names, order):
        offsets = np.asarray(statics[0].levels[0])
        counts = np.diff(offsets)
        for value, name in zip(statics[1:], names[1:]):
            if not np.array_equal(np.diff(np.asarray(value.levels[0])), counts):
                raise LoDError(f"cuda backend: the ragged static inputs {names[0]} and {name} have "
                               "different lengths (one LoD for all of them on this backend)")
        ordered = counts[order]
        self.mstart = np.concatenate([[0], np.cumsum(ordered)]).astype(np.int64)
        self.row_of = np.repeat(np.arange(len(order)), ordered).astype(np.int64)
        parts = [np.arange(offsets[s], offsets[s + 1]) for s in order]
        self.pack = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        self.rows = int(self.mstart[-1])
        self.counts = counts  # rows per sequence, the caller's order
        if self.rows == 0:  # kernels read these arrays: never empty
            self.row_of = np.zeros(1, np.int64)

    def step_offsets(self, nbs):
        """Where each step's rows start in a ragged all-steps output (one more
        entry: the total)."""
        return np.concatenate([[0], np.cumsum(self.mstart[nbs])]).astype(np.int64)

    def all_steps(self, host, out, nbs, sorted_lengths, order, level, reverse):
        """A ragged all-steps output written step by step (each step its
        active sequences' rows in packed order) as a LoDTensor of levels
        (sequence, step, rows)."""
        lengths = np.diff(np.asarray(level))
        entry_rows = np.repeat(self.counts, lengths)  # rows of each step of each sequence
        inner = np.concatenate([[0], np.cumsum(entry_rows)]).astype(np.int64)
        per_step = self.mstart[nbs]
        t = np.repeat(np.arange(len(nbs)), per_step)
        r = np.concatenate([np.arange(n) for n in per_step]) if len(per_step) else t
        b = self.row_of[r]
        position = sorted_lengths[b] - 1 - t if reverse else t
        dest = inner[np.asarray(level)[:-1][order[b]] + position] + r - self.mstart[b]
        data = np.empty((int(inner[-1]),) + tuple(out.shape[1:]), out.dtype)
        data[dest] = host[:len(dest)].reshape((len(dest),) + tuple(out.shape[1:]))
        return LoDTensor(data, [np.asarray(level), inner])


def _no_steps(eqn, body, initial, seq_args, num_seq, ragged_args):
    inits = ir.rnn_parts(eqn)[2]
    ragged_memories = eqn.attrs.get("ragged_memories", {})
    statics = [i for i, v in enumerate(body.static_inputs) if v.lod_depth]
    results = []
    for k, (out, all_steps) in enumerate(zip(body.outputs, eqn.attrs["all_steps"])):
        shape = tuple(out.shape[1:])
        mi = eqn.attrs["output_memory"][k]
        if not all_steps and mi in ragged_memories:
            like = ragged_args[statics.index(ragged_memories[mi])]
            results.append(LoDTensor(np.full(np.shape(like.data), initial(inits[mi]), out.dtype),
                                     like.levels))
            continue
        if all_steps:  # (a ragged one: no step's rows either)
            results.append(LoDTensor(np.zeros((0,) + shape, out.dtype),
                                     [seq_args[0].levels[0]] + [[0]] * out.lod_depth))
            continue
        mi = eqn.attrs["output_memory"][k]
        start = (np.broadcast_to(np.asarray(initial(inits[mi]), out.dtype), (num_seq,) + shape)
                 if mi >= 0 else np.zeros((num_seq,) + shape, out.dtype))
        results.append(np.array(start))
    return results
