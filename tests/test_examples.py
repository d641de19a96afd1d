"""The examples run as scripts and print the shapes they promise."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_paddle_design_doc():
    out = run_example("paddle_design_doc.py")
    # 1. h_t = U h_{t-1} + W x_t over 3 sequences of 4, 0, 2 steps
    assert "out: shape (6, 20), lod [[0, 4, 4, 6]]" in out
    assert "out (last step): shape (3, 20)" in out
    # 2. the two-level model, last step per chapter
    assert "chapter_out: shape (3, 20)" in out
    assert "chapter_out (all steps): shape (6, 20), lod [[0, 2, 3, 6]]" in out


def test_nested_chapters():
    out = run_example("nested_chapters.py")
    data = re.search(r"chapter_data: shape \((\d+), 16\), lod (\[\[.*\]\])", out)
    assert data, out
    rows, lod = int(data.group(1)), ast.literal_eval(data.group(2))
    num_chapters, num_paragraphs = len(lod[0]) - 1, lod[0][-1]
    assert num_chapters == 4 and len(lod) == 2
    all_steps = out.split("all steps:")[1].split("last step")[0]
    assert f"chapter_state: shape ({num_paragraphs}, 8), lod {lod[:1]}\n" in all_steps
    assert f"sentence_states: shape ({rows}, 8), lod {lod}\n" in all_steps
    assert f"paragraph_summary: shape ({num_paragraphs}, 8), lod {lod[:1]}\n" in all_steps
    last = out.split("last step (output_all_steps=False):")[1].split("rebound")[0]
    assert "chapter_state: shape (4, 8)\n" in last
    assert "paragraph_summary: shape (4, 8)\n" in last
    assert re.search(r"sentence_states: shape \(\d+, 8\), lod \[\[0(, \d+){4}\]\]\n", last)
    assert "rebound, last step:\n  chapter_state: shape (5, 8)" in out


def _load_example(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name[:-3], ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_adding_problem_learns_a_short_version():
    """A GRU trained with gradients through time beats the trivial baseline
    (MSE ~0.167) by far on the adding problem with sequences of 20."""
    mse = _load_example("train_adding_problem.py").main(
        ["--length", "20", "--steps", "300", "--log-every", "0"])
    assert mse < 0.01


@pytest.mark.slow
def test_train_nested_beats_the_one_level_bound():
    accuracy, bound = _load_example("train_nested.py").main(["--log-every", "0"])
    assert accuracy >= 0.9 and accuracy > bound + 0.1


@pytest.mark.slow  # (attention: test_attention.py; a training example: the adding problem)
def test_train_attention_learns_a_short_version():
    """250 steps of the attention seq2seq already reverse most digits."""
    assert _load_example("train_attention.py").main(
        ["--steps", "250", "--log-every", "0", "--test-size", "40", "--target", "0.6"]) == 0


@pytest.mark.slow
def test_train_attention_reaches_its_target():
    assert _load_example("train_attention.py").main(["--log-every", "0"]) == 0


@pytest.mark.parametrize("name", ["paddle_design_doc.py", "nested_chapters.py",
                                  "train_adding_problem.py", "train_nested.py",
                                  "train_attention.py"])
def test_examples_document_themselves(name):
    text = (ROOT / "examples" / name).read_text()
    assert text.startswith('"""') and "Run it:" in text


def test_onnx_roundtrip(tmp_path):
    pytest.importorskip("onnxruntime")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "onnx_roundtrip.py")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "stepnet session vs stepnet:" in proc.stdout and "onnxruntime vs stepnet:" in proc.stdout
    assert (tmp_path / "cell.onnx").exists()
