"""Every loader fuzzed: YAML models, ``.npz`` inputs and ONNX models, each
built from the project's own valid files (the examples, what stepnet exports)
and damaged by truncation, byte flips, deleted or duplicated fields, values
of the wrong type and absurd dimensions, by a fixed corpus and by
hypothesis. Each damaged file either runs, giving the undamaged file's
outputs where the change means nothing, or raises a stepnet error whose
message names the file; never another exception, a hang or a crash.

Models run on the interpreter: nothing here compiles a kernel.
"""

import copy
import random
import re
import signal
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepnet as sn
from conftest import assert_close
from stepnet import cli
from stepnet.npz import load_npz, save_npz

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
YAML_FILES = sorted(EXAMPLES.glob("*.yaml"))
FUZZ = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# values of the wrong type or absurd size, put where the files have others
WRONG = [None, "x", -1, 0, 1.5, True, [], {"a": 1}, [0], [-3], [1, 2, 3], 10**12, 2**63, "nan"]
HUGE = [10**12, 2**63, [10**12], [200000, 200000], [2**40, 2**40]]


# a damaged case still running after this many seconds hangs (each takes
# well under one): it fails with a TimeoutError instead of holding the suite
HANG_SECONDS = 60


def _hung(signum, frame):
    raise TimeoutError(f"still running after {HANG_SECONDS} s: a hang")


def _fails_well(path, call):
    """``call()``'s result, or None where it raised a stepnet error naming
    ``path``; any other exception, or an error that does not name the file,
    propagates or fails; so does a call still running after
    ``HANG_SECONDS``."""
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(HANG_SECONDS)
    try:
        return call()
    except sn.Error as exc:
        if str(path) not in str(exc):
            raise AssertionError(f"{type(exc).__name__} does not name {path}: {exc}") from exc
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _same(got, expected, what):
    """A model's outputs by name (or a session's list) equal the undamaged file's."""
    if isinstance(expected, dict):
        assert sorted(got) == sorted(expected), what
        got, expected = [got[k] for k in sorted(got)], [expected[k] for k in sorted(got)]
    assert_close(got, expected, what=what)


def _check(cases, run):
    """Run every ``(description, case)``; the descriptions of those that
    raised something else than a stepnet error naming the file."""
    failed = []
    for what, case in cases:
        try:
            run(case)
        except Exception as exc:  # noqa: BLE001  (collected: every bad case is listed)
            failed.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
    return failed


# ----------------------------------------------------------------------------
# YAML models


def _yaml_outputs(path, feeds=None):
    model = sn.load_yaml(path)
    feeds = model.random_feeds(seed=0, num_sequences=2, max_length=3) if feeds is None else feeds
    return model(feeds, backend="interpreter")


def _key_paths(data, path=()):
    """Every key path of a YAML document (mapping keys and list indices)."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        yield path + (key,)
        yield from _key_paths(value, path + (key,))


def _mutated(data, path, kind, value=None):
    """A copy of ``data`` with the key at ``path`` deleted, duplicated (a
    list item) or set to ``value``."""
    data = copy.deepcopy(data)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if kind == "delete":
        del parent[path[-1]]
    elif kind == "duplicate":
        parent.insert(path[-1], copy.deepcopy(parent[path[-1]]))
    else:
        parent[path[-1]] = value
    return data


def _yaml_cases(seed, per_file):
    """``(description, text)``: a sample of each kind of damage to each example."""
    rng = random.Random(seed)
    for file in YAML_FILES:
        text = file.read_text()
        data = yaml.safe_load(text)
        paths = list(_key_paths(data))
        for path in rng.sample(paths, min(per_file, len(paths))):
            yield f"{file.name} delete {path}", yaml.safe_dump(_mutated(data, path, "delete"))
            if isinstance(path[-1], int):
                yield (f"{file.name} duplicate {path}",
                       yaml.safe_dump(_mutated(data, path, "duplicate")))
            for value in rng.sample(WRONG + HUGE, 3):
                yield (f"{file.name} {path} = {value!r}",
                       yaml.safe_dump(_mutated(data, path, "set", value)))
        raw = text.encode()
        for cut in range(0, len(raw), len(raw) // 6):
            yield f"{file.name} cut at {cut}", raw[:cut]
        for _ in range(6):
            at = rng.randrange(len(raw))
            yield f"{file.name} byte {at} flipped", raw[:at] + bytes([raw[at] ^ 0xA5]) + raw[at + 1:]


def _run_yaml(tmp_path, content):
    path = tmp_path / "fuzzed.yaml"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    _fails_well(path, lambda: _yaml_outputs(path))


def test_damaged_yaml_models_raise_a_stepnet_error_naming_the_file(tmp_path):
    cases = list(_yaml_cases(seed=63, per_file=14))
    assert len(cases) > 200
    assert _check(cases, lambda text: _run_yaml(tmp_path, text)) == []


@pytest.mark.parametrize("file", YAML_FILES, ids=lambda f: f.name)
def test_yaml_changes_that_mean_nothing_give_the_same_outputs(file, tmp_path):
    model = sn.load_yaml(file)
    feeds = model.random_feeds(seed=0, num_sequences=2, max_length=3)
    expected = model(feeds, backend="interpreter")
    data = yaml.safe_load(file.read_text())
    same = {"dumped again": yaml.safe_dump(data, sort_keys=True),
            "as flow style": yaml.safe_dump(data, default_flow_style=True),
            "comments and blank lines": "# a comment\n\n" + file.read_text().replace(
                "\n", "\n\n", 3) + "\n# the end\n",
            "a description more": yaml.safe_dump({**data, "description": "changed"}),
            "keys in reverse order": yaml.safe_dump(dict(reversed(list(data.items()))),
                                                    sort_keys=False)}
    for what, text in same.items():
        path = tmp_path / f"{what.replace(' ', '_')}.yaml"
        path.write_text(text)
        _same(_yaml_outputs(path, feeds), expected, f"{file.name} {what}")


@st.composite
def _yaml_mutation(draw):
    file = draw(st.sampled_from(YAML_FILES))
    data = yaml.safe_load(file.read_text())
    path = draw(st.sampled_from(list(_key_paths(data))))
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                       st.floats(allow_nan=True), st.text(max_size=12))
    value = draw(st.one_of(scalar, st.lists(scalar, max_size=3),
                           st.dictionaries(st.text(max_size=5), scalar, max_size=2)))
    return yaml.safe_dump(_mutated(data, path, "set", value))


@FUZZ
@given(text=_yaml_mutation())
def test_hypothesis_yaml_values(tmp_path, text):
    _run_yaml(tmp_path, text)


@FUZZ
@given(data=st.data())
def test_hypothesis_yaml_bytes(tmp_path, data):
    raw = bytearray(data.draw(st.sampled_from(YAML_FILES)).read_bytes())
    for at, byte in data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1),
                                                 st.integers(0, 255)), min_size=1, max_size=4)):
        raw[at] = byte
    cut = data.draw(st.integers(0, len(raw)))
    _run_yaml(tmp_path, bytes(raw[:cut]))


def test_yaml_that_is_not_text_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(sn.YAMLError, match=rf"^{re.escape(str(path))}:1: \(document\): byte 0xe9 "
                                           r"at offset 9 is not UTF-8 text$"):
        sn.load_yaml(path)
    path.write_text("name: x\ninputs:\n  x: {shape: [4]}\x1c\n")
    with pytest.raises(sn.YAMLError, match=rf"^{re.escape(str(path))}:3: inputs.x: bad YAML: "
                                           r"character U\+001C: special characters"):
        sn.load_yaml(path)


# ----------------------------------------------------------------------------
# .npz inputs


@pytest.fixture(scope="module")
def npz_models():
    """``{name: (model, feeds, outputs)}`` for the examples with a LoD of one
    and of two levels."""
    found = {}
    for name in ("char_gru", "hierarchical"):
        model = sn.load_yaml(EXAMPLES / f"{name}.yaml")
        feeds = model.random_feeds(seed=1, num_sequences=2, max_length=3)
        found[name] = model, feeds, model(feeds, backend="interpreter")
    return found


def _npz_arrays(feeds):
    arrays = {}
    for name, value in feeds.items():
        if isinstance(value, sn.LoDTensor):
            arrays[name] = value.data
            arrays.update({f"{name}.lod.{k}": np.asarray(level)
                           for k, level in enumerate(value.levels)})
        else:
            arrays[name] = value
    return arrays


NPZ_VALUES = [np.array([]), np.array(3), np.array(["a", "b"]), np.array([1 + 2j]),
              np.array([1.5, 2.5]), np.array([-1, 5]), np.array([0, 2**62, 2**63 - 1]),
              np.array([2**62, 2**62]), np.zeros((2, 3, 4)), np.array([True]),
              np.array([0, 3_000_000_000]), np.array([np.nan]), np.zeros((0, 48)),
              np.zeros((2, 0)), np.array([0, 1, 2], np.uint64), np.array([0, -1, 2]),
              np.array([2**63 - 1, 2], np.uint64), np.array([None, 1], dtype=object)]


def _npz_cases(npz_models, tmp_path):
    """``(description, (model, path))``: each array of each model's inputs
    deleted, replaced by a wrong value, retyped or reshaped; the file cut
    and flipped."""
    rng = random.Random(64)
    for name, (model, feeds, _) in npz_models.items():
        arrays = _npz_arrays(feeds)
        for key in arrays:
            changes = {"deleted": None, "as float16": arrays[key].astype(np.float16),
                       "as int8": arrays[key].astype(np.int8), "transposed": arrays[key].T,
                       "one axis more": arrays[key][..., None]}
            changes.update((f"= {v!r}"[:40], v) for v in NPZ_VALUES)
            for what, value in changes.items():
                changed = {k: v for k, v in arrays.items() if k != key}
                if value is not None:
                    changed[key.replace(".lod.", ".lengths.") if what.startswith("=") and rng.random()
                            < 0.3 else key] = value
                path = tmp_path / f"{len(list(tmp_path.iterdir()))}.npz"
                np.savez(path, **changed, allow_pickle=True) if value is not None and \
                    value.dtype == object else np.savez(path, **changed)
                yield f"{name} {key} {what}", (model, path)
        good = tmp_path / f"{name}.npz"
        save_npz(good, feeds)
        raw = good.read_bytes()
        for k in range(24):
            path = tmp_path / f"{name}-damaged-{k}.npz"
            at = rng.randrange(len(raw))
            path.write_bytes(raw[:rng.randrange(len(raw))] if k % 3 == 0 else
                             raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1:])
            yield f"{name} bytes damaged ({k})", (model, path)


def _run_npz(model, path):
    _fails_well(path, lambda: model(load_npz(path, model), backend="interpreter"))


def test_damaged_npz_inputs_raise_a_stepnet_error_naming_the_file(npz_models, tmp_path):
    cases = list(_npz_cases(npz_models, tmp_path))
    assert len(cases) > 100
    assert _check(cases, lambda case: _run_npz(*case)) == []


def test_npz_changes_that_mean_nothing_give_the_same_outputs(npz_models, tmp_path):
    for name, (model, feeds, expected) in npz_models.items():
        arrays = _npz_arrays(feeds)
        lengths = {k.replace(".lod.", ".lengths."): np.diff(v)
                   for k, v in arrays.items() if ".lod." in k}
        same = {"compressed": (np.savez_compressed, arrays),
                "lengths, not offsets": (np.savez, {**{k: v for k, v in arrays.items()
                                                       if ".lod." not in k}, **lengths}),
                "int32 offsets": (np.savez, {k: v.astype(np.int32) if ".lod." in k else v
                                             for k, v in arrays.items()}),
                "an array more": (np.savez, {**arrays, "unread": np.zeros(3)})}
        for what, (save, content) in same.items():
            path = tmp_path / f"{name}-{what.replace(' ', '_')}.npz"
            save(path, **content)
            warned = []
            _same(model(load_npz(path, model, warn=warned.append), backend="interpreter"),
                  expected, f"{name} {what}")
            assert bool(warned) == (what == "an array more")


def test_an_npz_array_too_large_is_refused_from_its_header(npz_models, tmp_path):
    """A compressed file of a few KiB declaring terabytes: refused before it
    is read (the header gives shape and dtype)."""
    model = npz_models["char_gru"][0]
    path = tmp_path / "bomb.npz"
    header = {"descr": "<f4", "fortran_order": False, "shape": (1_000_000, 1_000_000)}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z, z.open("chars.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(bytes(4096))
    with pytest.raises(sn.SizeError, match=rf"{re.escape(str(path))}: array 'chars' \[1000000, "
                                           r"1000000\] float32 needs 3.6 TiB, more than"):
        load_npz(path, model)


@FUZZ
@given(data=st.data())
def test_hypothesis_npz_arrays(npz_models, tmp_path, data):
    name = data.draw(st.sampled_from(sorted(npz_models)))
    model, feeds, _ = npz_models[name]
    arrays = _npz_arrays(feeds)
    key = data.draw(st.sampled_from(sorted(arrays)))
    dtype = data.draw(st.sampled_from([np.int64, np.int32, np.uint8, np.float32, np.float64,
                                       np.bool_, np.complex64, np.str_]))
    shape = data.draw(st.lists(st.integers(0, 5), max_size=3))
    values = data.draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=int(np.prod(shape)),
                                max_size=int(np.prod(shape))))
    arrays[key] = np.array(values, np.int64).astype(dtype).reshape(shape)
    path = tmp_path / "fuzzed.npz"
    np.savez(path, **arrays)
    _run_npz(model, path)


# ----------------------------------------------------------------------------
# ONNX models


def _small_model():
    """A hand-made graph (MatMul, Add, Tanh, Reshape, an initializer read as a
    shape): the ops of an exported feed-forward head."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.arange(8, dtype=np.float32).reshape(4, 2) / 10, "W"),
             numpy_helper.from_array(np.array([0.5, -0.5], np.float32), "B"),
             numpy_helper.from_array(np.array([-1, 2], np.int64), "S")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "B"], ["a"], name="add"),
             helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
             helper.make_node("Reshape", ["t", "S"], ["y"], name="reshape")]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["N", 4])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["N", 2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def onnx_models():
    """``{name: (ModelProto, feeds, outputs)}``: a GRU as stepnet exports it,
    and a small hand-made graph."""
    pytest.importorskip("onnx")
    found = {}
    for name, model, feeds in (
            ("gru", sn.onnx.export(sn.nn.GRU(3, 4, seed=0)),
             {"X": np.linspace(-1, 1, 30, dtype=np.float32).reshape(2, 5, 3),
              "lengths": np.array([5, 2])}),
            ("small", _small_model(), {"x": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)})):
        session = sn.onnx.InferenceSession(model, backend="interpreter")
        found[name] = model, feeds, session.run(None, feeds)
    return found


def _run_onnx(path, feeds):
    _fails_well(path, lambda: sn.onnx.InferenceSession(str(path), backend="interpreter")
                .run(None, feeds))


def _onnx_changes(model):
    """``(description, changed ModelProto)``: each initializer, node, graph
    input and opset import deleted, duplicated or given a wrong value."""
    from onnx import TensorProto

    graph = model.graph
    for i, t in enumerate(graph.initializer):
        for what, change in (
                ("dims [0]", lambda t: t.dims.__setitem__(0, 0) if t.dims else t.dims.append(0)),
                ("dims [-1]", lambda t: t.dims.__setitem__(0, -1) if t.dims else t.dims.append(-1)),
                ("dims huge", lambda t: t.dims.extend([2**40, 2**40])),
                ("no element type", lambda t: setattr(t, "data_type", 0)),
                ("element type 99", lambda t: setattr(t, "data_type", 99)),
                ("as strings", lambda t: setattr(t, "data_type", TensorProto.STRING)),
                ("raw data cut", lambda t: setattr(t, "raw_data", t.raw_data[:3])),
                ("as float64", lambda t: setattr(t, "data_type", TensorProto.DOUBLE))):
            changed = copy.deepcopy(model)
            change(changed.graph.initializer[i])
            yield f"initializer {t.name} {what}", changed
        changed = copy.deepcopy(model)
        del changed.graph.initializer[i]
        yield f"initializer {t.name} deleted", changed
    for i, node in enumerate(graph.node):
        for what, change in (
                ("deleted", lambda g, n: g.node.remove(n)),
                ("duplicated", lambda g, n: g.node.add().CopyFrom(n)),
                ("op Nope", lambda g, n: setattr(n, "op_type", "Nope")),
                ("reads an unknown name", lambda g, n: n.input.__setitem__(0, "nowhere")),
                ("first input left out", lambda g, n: n.input.__setitem__(0, "")),
                ("output renamed to an input", lambda g, n: n.output.__setitem__(
                    0, g.input[0].name)),
                ("attributes as strings", lambda g, n: [setattr(a, "type", 3)
                                                        for a in n.attribute]),
                ("hidden_size 0", lambda g, n: [setattr(a, "i", 0) for a in n.attribute
                                                if a.name == "hidden_size"])):
            changed = copy.deepcopy(model)
            change(changed.graph, changed.graph.node[i])
            yield f"node {node.name or node.op_type} {what}", changed
    for i, arg in enumerate(graph.input):
        for what, change in (
                ("element type 99", lambda a: setattr(a.type.tensor_type, "elem_type", 99)),
                ("as int64", lambda a: setattr(a.type.tensor_type, "elem_type",
                                               TensorProto.INT64)),
                ("dims huge", lambda a: [d.__setattr__("dim_value", 2**40)
                                         for d in a.type.tensor_type.shape.dim]),
                ("one axis more", lambda a: a.type.tensor_type.shape.dim.add()),
                ("no type", lambda a: a.ClearField("type"))):
            changed = copy.deepcopy(model)
            change(changed.graph.input[i])
            yield f"input {arg.name} {what}", changed
    for version in (0, -1, 2**40):
        changed = copy.deepcopy(model)
        changed.opset_import[0].version = version
        yield f"opset {version}", changed
    changed = copy.deepcopy(model)
    del changed.opset_import[:]
    yield "no opset", changed


def test_damaged_onnx_models_raise_a_stepnet_error_naming_the_file(onnx_models, tmp_path):
    cases = []
    rng = random.Random(65)
    for name, (model, feeds, _) in onnx_models.items():
        for what, changed in _onnx_changes(model):
            cases.append((f"{name} {what}", (changed.SerializeToString(), feeds)))
        raw = model.SerializeToString()
        for k in range(30):
            at = rng.randrange(len(raw))
            cases.append((f"{name} bytes damaged ({k})", (
                raw[:rng.randrange(len(raw))] if k % 3 == 0 else
                raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1:], feeds)))
    assert len(cases) > 150
    path = tmp_path / "fuzzed.onnx"

    def run(case):
        path.write_bytes(case[0])
        _run_onnx(path, case[1])

    assert _check(cases, run) == []


def test_onnx_changes_that_mean_nothing_give_the_same_outputs(onnx_models, tmp_path):
    from onnx import numpy_helper

    for name, (model, feeds, expected) in onnx_models.items():
        unnamed = copy.deepcopy(model)
        for node in unnamed.graph.node:
            node.name, node.doc_string = "", "changed"
        unused = copy.deepcopy(model)
        unused.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "unused"))
        reordered = copy.deepcopy(model)
        inits = list(reordered.graph.initializer)[::-1]
        del reordered.graph.initializer[:]
        reordered.graph.initializer.extend(inits)
        for what, changed in (("nodes unnamed", unnamed), ("an unused initializer", unused),
                              ("initializers reordered", reordered)):
            path = tmp_path / f"{name}-{what.replace(' ', '_')}.onnx"
            path.write_bytes(changed.SerializeToString())
            got = sn.onnx.InferenceSession(str(path), backend="interpreter").run(None, feeds)
            _same(got, expected, f"{name} {what}")


@FUZZ
@given(data=st.data())
def test_hypothesis_onnx_fields(onnx_models, tmp_path, data):
    """A scalar field anywhere in the model set to another value."""
    name = data.draw(st.sampled_from(sorted(onnx_models)))
    model, feeds, _ = onnx_models[name]
    changed = copy.deepcopy(model)
    messages = [changed]
    for message in messages:  # every message of the model, breadth first
        for field, value in message.ListFields():
            if field.type == field.TYPE_MESSAGE:
                messages.extend(value if field.is_repeated else [value])
    message = data.draw(st.sampled_from(messages))
    scalars = [f for f, _ in message.ListFields() if f.type != f.TYPE_MESSAGE]
    if scalars:
        field = data.draw(st.sampled_from(scalars))
        value = data.draw({
            field.TYPE_INT64: st.integers(-2**63, 2**63 - 1),
            field.TYPE_INT32: st.integers(-2**31, 2**31 - 1),
            field.TYPE_FLOAT: st.floats(width=32),
            field.TYPE_STRING: st.text(max_size=8),
            field.TYPE_BYTES: st.binary(max_size=16),
        }.get(field.type, st.integers(0, 40)))
        try:
            if field.is_repeated:
                getattr(message, field.name)[0] = value
            else:
                setattr(message, field.name, value)
        except (TypeError, ValueError):  # (not a value the field can hold)
            pass
    path = tmp_path / "fuzzed.onnx"
    path.write_bytes(changed.SerializeToString())
    _run_onnx(path, feeds)


@FUZZ
@given(data=st.data())
def test_hypothesis_onnx_bytes(onnx_models, tmp_path, data):
    name = data.draw(st.sampled_from(sorted(onnx_models)))
    raw = bytearray(onnx_models[name][0].SerializeToString())
    for at, byte in data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1),
                                                 st.integers(0, 255)), min_size=1, max_size=3)):
        raw[at] = byte
    path = tmp_path / "fuzzed.onnx"
    path.write_bytes(bytes(raw[:data.draw(st.integers(1, len(raw)))]))
    _run_onnx(path, onnx_models[name][1])


# ----------------------------------------------------------------------------
# the stepnet command


def test_the_command_names_the_damaged_file_in_one_line(npz_models, tmp_path, capsys):
    yaml_path = tmp_path / "cut.yaml"
    yaml_path.write_bytes((EXAMPLES / "char_gru.yaml").read_bytes()[:700])
    npz_path = tmp_path / "cut.npz"
    save_npz(npz_path, npz_models["char_gru"][1])
    npz_path.write_bytes(npz_path.read_bytes()[:300])
    not_text = tmp_path / "not_text.yaml"
    not_text.write_bytes(b"name: \xff\xfe\n")
    for argv, named in ((["check", str(yaml_path)], yaml_path),
                        (["run", str(EXAMPLES / "char_gru.yaml"), "--input", str(npz_path),
                          "--backend", "interpreter", "--quiet"], npz_path),
                        (["run", str(not_text)], not_text)):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("stepnet: error: ") and str(named) in err, err
        assert err.count("\n") == 1 and "Traceback" not in err


# ----------------------------------------------------------------------------
# damage that once raised a raw exception, in the model's builder and the
# layers (a hashable type, a bound on lod_level, arithmetic on constants, the
# layers' parameters' sizes)

ONCE_RAW = [
    ("attention_decoder.yaml", ("layers", "encoder", "type"), [], "layer type"),
    ("attention_decoder.yaml", ("cells", "step_cell", "type"), [], "cell type"),
    ("custom_cell.yaml", ("nets", "mgu", "step", 0, "op"), [], "op"),
    ("char_gru.yaml", ("inputs", "chars", "lod_level"), 10**12, "lod_level"),
    ("char_gru.yaml", ("nets", "gru", "step", 0), "r = sigmoid(x @ W_r + 1/0)",
     "a constant divided by zero"),
    ("attention_decoder.yaml", ("layers", "encoder", "hidden_size"), 10**12,
     "a hidden size that cannot fit"),
    ("attention_decoder.yaml", ("cells", "step_cell", "input_size"), 10**12,
     "a cell input size that cannot fit"),
]


@pytest.mark.parametrize("file, path, value, what", ONCE_RAW, ids=[c[3] for c in ONCE_RAW])
def test_damage_that_once_raised_a_raw_exception(tmp_path, file, path, value, what):
    data = yaml.safe_load((EXAMPLES / file).read_text())
    damaged = tmp_path / "fuzzed.yaml"
    damaged.write_text(yaml.safe_dump(_mutated(data, path, "set", value)))
    assert _fails_well(damaged, lambda: _yaml_outputs(damaged)) is None  # (a stepnet error)
