"""Data files: a model's inputs and outputs as ``.npz``, and directories of
``.npz`` shards (used by ``stepnet run`` and by stepnet.distributed).

An input ``x`` with a LoD is the array ``x`` (its data rows) plus
``x.lod.0``, ``x.lod.1``, ... (offsets, coarsest level first) or
``x.lengths.0``, ...; a ``lod_level: 0`` input is the array alone. Outputs are
written the same way (``name``, ``name.lod.K``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from . import sizes
from .errors import Error, LoDError, ShapeError, StepNetError
from .lod import LoDTensor


class NotAnNpz(Error):
    """A file given as an ``.npz`` that is another kind of file."""


def open_npz(path):
    """``np.load(path)`` of an ``.npz`` file; an ``.npy`` file or one that is
    no zip archive raises NotAnNpz (NumPy would offer to unpickle it)."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head.startswith(b"\x93NUMPY"):
        raise NotAnNpz("it is an .npy file (one array), not an .npz (np.savez writes those)")
    if not head.startswith(b"PK"):
        raise NotAnNpz("it is not an .npz file (a zip archive, as np.savez writes)")
    return np.load(path, allow_pickle=False)


def load_npz(path, model, warn=None):
    """The model's inputs from an ``.npz`` file (see the module docstring).

    ``warn(text)``, if given, is told which arrays of the file the model does
    not read (``x.lod.K`` and ``x.lengths.K`` of an input ``x`` with K below
    its ``lod_level`` count as read)."""
    try:
        with open_npz(path) as npz:
            for key in npz.files:
                _check_size(path, npz, key)
            arrays = {k: npz[k] for k in npz.files}
    except NotAnNpz as exc:
        raise Error(f"cannot read input data {str(path)!r}: {exc}") from None
    except Error:
        raise
    except FileNotFoundError:
        raise Error(f"cannot read input data {str(path)!r}: no such file") from None
    except Exception as exc:  # noqa: BLE001  (zipfile's, zlib's and NumPy's own errors, named here)
        raise Error(f"cannot read input data {str(path)!r}: {type(exc).__name__}: {exc} (a "
                    "truncated or damaged file, or not an .npz file)") from None
    feeds = {}
    read = set()
    for name, spec in model.inputs.items():
        if name not in arrays:
            raise Error(f"{path}: no array {name!r} for input {name!r} "
                        f"(it has {', '.join(sorted(arrays)) or 'nothing'})")
        read.add(name)
        data = _rows(path, name, arrays[name], spec)
        if spec.lod_level == 0:
            feeds[name] = data
            continue
        offsets = [arrays.get(f"{name}.lod.{k}") for k in range(spec.lod_level)]
        lengths = [arrays.get(f"{name}.lengths.{k}") for k in range(spec.lod_level)]
        read.update(f"{name}.{kind}.{k}" for kind in ("lod", "lengths") for k in range(spec.lod_level))
        try:
            if all(o is not None for o in offsets):
                feeds[name] = LoDTensor(data, offsets)
                known = feeds[name].lengths
                for k, given in enumerate(lengths):
                    if given is not None and np.asarray(given).tolist() != known[k]:
                        raise Error(f"{path}: input {name!r} has both {name}.lod.{k} and "
                                    f"{name}.lengths.{k}, and they disagree; give one of them")
            elif all(n is not None for n in lengths):
                feeds[name] = LoDTensor.from_lengths(data, lengths)
            else:
                raise Error(f"{path}: input {name!r} has lod_level {spec.lod_level}; give its LoD "
                            "as " + ", ".join(f"{name}.lod.{k}" for k in range(spec.lod_level))
                            + " (offsets) or as " + ", ".join(f"{name}.lengths.{k}" for k in
                                                              range(spec.lod_level)))
        except LoDError as exc:
            kind = "lod" if all(o is not None for o in offsets) else "lengths"
            raise LoDError(_lod_error(path, name, kind, spec.lod_level, str(exc))) from None
    unread = sorted(set(arrays) - read)
    if unread and warn is not None:
        warn(f"{path}: the model does not read array(s) {', '.join(unread)} "
             f"(its inputs: {', '.join(model.inputs)})")
    return feeds


def _check_size(path, npz, key):
    """Refuse an array of the file that would not fit before it is read:
    its header says its shape and dtype (a few bytes of a compressed file
    can declare terabytes)."""
    with npz.zip.open(key + ".npy") as stream:
        version = np.lib.format.read_magic(stream)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read(stream)
    sizes.check(f"{path}: array {key!r}", shape, dtype)


def _rows(path, name, data, spec):
    """The array ``name`` of ``path`` if it holds rows of input ``spec``:
    numbers of its row shape, else a ShapeError in the file's terms."""
    if data.dtype.kind not in "biuf":
        raise ShapeError(f"{path}: array {name!r} has dtype {data.dtype}; input {name!r} takes "
                         f"numbers ({spec.dtype})")
    if data.shape[1:] != tuple(spec.shape) or data.ndim == 0:
        rows = ", ".join(["rows", *map(str, spec.shape)])
        raise ShapeError(f"{path}: array {name!r} has shape {list(data.shape)}; input {name!r} "
                         f"takes [{rows}]")
    return data


def _lod_error(path, name, kind, num_levels, message) -> str:
    """A LoDError of input ``name`` read from ``path`` in the file's terms: the
    array at fault (``x.lengths.0``), which level that is, and ``'x'`` for the
    data."""
    match = re.match(r"^(?:lod|lengths) level (\d+)(?: \([^)]*\))?(.*)$", message, re.S)
    if match is None:
        return f"{path}: input {name!r}: {message}"
    k, rest = int(match.group(1)), match.group(2)
    which = ("the only level" if num_levels == 1 else "the coarsest" if k == 0
             else "the finest" if k == num_levels - 1 else None)
    rest = rest.replace("the data has", f"{name!r} has")
    rest = re.sub(r"\blevel (\d+) has", lambda m: f"{name}.{kind}.{m.group(1)} has", rest)
    return f"{path}: input {name!r}: {name}.{kind}.{k} (level {k}{', ' + which if which else ''}){rest}"


def save_npz(path, values) -> str:
    """Write named arrays and LoDTensors (``name``, ``name.lod.K``) to ``.npz``;
    the path written: ``path``, with ``.npz`` added where it has not that
    suffix (as NumPy adds it)."""
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    arrays = {}
    for name, value in values.items():
        if isinstance(value, LoDTensor):
            arrays[name] = value.data
            for k, offsets in enumerate(value.levels):
                arrays[f"{name}.lod.{k}"] = np.asarray(offsets)
        else:
            arrays[name] = np.asarray(value)
    try:
        np.savez(path, **arrays)
    except OSError as exc:
        raise Error(f"cannot write {path!r}: {exc.strerror or exc}") from None
    return path


def shard_files(directory) -> list:
    """The ``*.npz`` shards of ``directory``, in name order."""
    files = sorted(Path(directory).glob("*.npz"))
    if not files:
        raise StepNetError(f"{directory}: no .npz shards")
    return files


def shard_output_path(out_dir, shard) -> Path:
    """Where the outputs of ``shard`` go: ``out_dir/<shard name>``."""
    return Path(out_dir) / Path(shard).name
