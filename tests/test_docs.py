"""The README and docs/: no measurement logs (dates, commit hashes), a short
README, relative links that resolve, and the documentation site builds."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# the page where benchmarks/run.py's reports go, each naming its run
REPORTS = DOCS / "benchmarks.md"
README_MAX_LINES = 300

_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
          r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b"             # 2026-11-29
                  r"|\b\d{4}/\d{2}/\d{2}\b"             # 2026/11/29
                  rf"|\b{_MONTH}\.? \d{{1,2}}\b"        # Nov 29, November 29
                  rf"|\b\d{{1,2}} {_MONTH}\b")          # 29 Nov
# 7 to 40 lowercase hex digits as a whole word, with a letter and a digit in it
# (so neither a number nor a word like "deadbeef" or "facade")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def log_marks(text: str) -> list[str]:
    """The dates and commit hashes in ``text``."""
    return [m.group() for pattern in (DATE, COMMIT) for m in pattern.finditer(text)]


def prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub and MkDocs make it."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path):
    """The anchors of the headings of the markdown file ``path``."""
    seen: dict[str, int] = {}
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            yield base if n == 0 else f"{base}-{n}"


def broken_links(path: Path) -> list[str]:
    """The relative links of the markdown file ``path`` whose file, or whose
    anchor in a markdown file, does not exist."""
    broken = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in set(anchors(dest)):
            broken.append(target)
    return broken


def checked_for_logs() -> list[Path]:
    return [ROOT / "README.md"] + sorted(p for p in DOCS.rglob("*.md") if p != REPORTS)


def linked_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted(DOCS.rglob("*.md"))


# ---------------------------------------------------------------------------
# the checks themselves


@pytest.mark.parametrize("text", [
    "measured 2026-11-29 on the machine", "run of Nov 29, 04:17", "on 29 Nov", "2026/11/29",
    "September 3", "code 3c523aa", "at a2e3c79,", "(72c732a)",
    "commit 0123456789abcdef0123456789abcdef01234567",
])
def test_a_date_or_a_commit_hash_is_found(text):
    assert log_marks(text)


@pytest.mark.parametrize("text", [
    "deadbeef", "facade", "1234567", "0x7fffffff", "float32 and float64", "sha256",
    "W1 to W9, 1e-5", "may 3 rows", "(1 << 17)", "a 0.1.0 release", "[64, 256] @ [256, 768]",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa1",
])
def test_ordinary_words_are_not_taken_for_dates_or_hashes(text):
    assert not log_marks(text)


def test_a_missing_file_or_anchor_is_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## The `x` part: one\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](a.md) [ok](a.md#the-x-part-one) [ok](#here) [web](https://example.org/x)\n"
                    "## Here\n```\n[in code](nowhere.md)\n```\n"
                    "[gone](missing.md) [no anchor](a.md#nope)\n")
    assert broken_links(page) == ["missing.md", "a.md#nope"]


# ---------------------------------------------------------------------------
# the files


@pytest.mark.parametrize("path", checked_for_logs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dates_or_commit_hashes(path):
    """README.md and docs/ describe stepnet, not runs: measurement logs
    (dates, commits) belong in git's history; benchmark reports go to
    docs/benchmarks.md only."""
    found = [(n, mark) for n, line in enumerate(path.read_text().splitlines(), 1)
             for mark in log_marks(line)]
    assert not found, f"{path.relative_to(ROOT)}: dates or commit hashes at (line, text) {found}"


# a measured figure (a time with decimals, a rate) or a machine's name: what
# a log says, not why code is as it is (``literals`` are output samples)
_MEASURED = re.compile(r"\b\d+\.\d+ ?(ms|us|µs|s)\b|\b\d+(\.\d+)? ?GFLOP/s|\b(Xeon|EPYC|Zen ?\d|"
                       r"Skylake|Sapphire Rapids|Emerald Rapids|Cascade Lake|Ice Lake)\b")


def _comments_and_docstrings(path):
    """(line, text) of each comment and docstring line of a Python file."""
    import ast
    import io
    import tokenize

    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            for offset, text in enumerate((doc or "").splitlines()):
                yield node.body[0].lineno + offset, text


def test_no_comment_in_stepnet_logs_a_measurement():
    found = [f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
             for path in sorted((ROOT / "stepnet").rglob("*.py"))
             for line, text in _comments_and_docstrings(path)
             if _MEASURED.search(re.sub(r"``[^`]*``", "", text))]
    assert not found, "comments say why, figures go to docs/benchmarks.md:\n" + "\n".join(found)


@pytest.mark.parametrize("text", ["# 1.48-1.88 ms on the AMD EPYC", "on a Xeon", "110 GFLOP/s a core"])
def test_a_logged_measurement_is_found(text):
    assert _MEASURED.search(text)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("path", linked_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links {broken_links(path)}"


def test_the_documentation_site_builds(tmp_path):
    """``mkdocs build --strict`` (the ``docs`` extra): every page in the nav,
    the API reference generated from the docstrings, no warning."""
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
               if _missing(m)]
    if missing:
        pytest.skip(f"the docs extra is not installed (pip install -e '.[docs]'): no {', '.join(missing)}")
    if not (ROOT / "mkdocs.yml").exists():
        pytest.skip("no mkdocs.yml")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                             str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()
    shutil.rmtree(tmp_path / "site", ignore_errors=True)


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def test_ci_runs_exactly_the_readmes_test_command():
    """The README opens with two commands, the second installing the test
    dependencies and running the tests; CI runs that command, no other."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(commands) == 2 and commands[0].startswith("pip install") and "stepnet run" in commands[0]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == [commands[1]]


# ---------------------------------------------------------------------------
# the reference pages: the environment variables, the command line, the ops

ENVIRONMENT = DOCS / "environment.md"
CLI_PAGE = DOCS / "cli.md"
OPS_PAGE = DOCS / "ops.md"
ENV_NAME = re.compile(r"\bSTEPNET_[A-Z_]+\b")
REGENERATE = "regenerate it with `python tests/test_docs.py --write`"


def environment_variables_in_code() -> dict[str, list[str]]:
    """Every ``STEPNET_*`` name in stepnet's source, with the files that name it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "stepnet").rglob("*.py")):
        for name in set(ENV_NAME.findall(path.read_text())):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def environment_table_names() -> set[str]:
    """The variables of docs/environment.md's table (its rows' first cells)."""
    return {m.group(1) for m in re.finditer(r"^\|\s*`(STEPNET_[A-Z_]+)`", ENVIRONMENT.read_text(), re.M)}


def test_every_environment_variable_is_documented():
    missing = {name: files for name, files in environment_variables_in_code().items()
               if name not in environment_table_names()}
    assert not missing, f"docs/environment.md's table lacks (variable: files reading it) {missing}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def cli_markdown() -> str:
    """docs/cli.md, from ``stepnet.cli``'s argument parser."""
    import argparse

    from stepnet import cli

    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    lines = ["# Command line", "",
             "<!-- generated from stepnet/cli.py's argument parser by tests/test_docs.py; "
             "regenerate: python tests/test_docs.py --write -->", "",
             f"{parser.description}", "",
             "```text", "stepnet COMMAND [OPTIONS]", "stepnet --version     # print stepnet's version",
             "stepnet COMMAND --help", "```", "",
             "| command | what it does |", "|---|---|"]
    lines += [f"| [`{name}`](#stepnet-{name}) | {_cell(helps[name])} |" for name in commands.choices]
    for name, sub in commands.choices.items():
        lines += ["", f"## stepnet {name}", "", _cell(sub.description or helps[name]), ""]
        positional = " ".join(a.metavar or a.dest for a in sub._actions if not a.option_strings)
        lines += ["```text", f"stepnet {name} {positional} [OPTIONS]".replace("  ", " "), "```", ""]
        rows = []
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            metavar = "" if action.nargs == 0 else " " + (action.metavar or action.dest.upper())
            if action.option_strings:
                flags = sorted(action.option_strings, key=lambda s: (not s.startswith("--"), s))
                what = ", ".join(f"`{flag}{metavar if i == 0 else ''}`" for i, flag in enumerate(flags))
            else:
                what = f"`{action.metavar or action.dest}`"
            required = " (required)" if action.required and action.option_strings else ""
            rows.append(f"- {what}: {' '.join((action.help or '').split())}{required}")
        if rows:
            lines += rows
        else:
            lines += ["No arguments."]
    return "\n".join(lines) + "\n"


def _first_line(doc: str | None) -> str:
    """A docstring's first sentence, on one line."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    return text


def ops_markdown() -> str:
    """docs/ops.md, from the op registry and ``stepnet.ops.composites``."""
    from stepnet import ops, registry

    lines = ["# Op table", "",
             "<!-- generated from the op registry (stepnet/registry.py) by tests/test_docs.py; "
             "regenerate: python tests/test_docs.py --write -->", "",
             "Every op is `sn.ops.NAME`. The primitives are the entries of the op registry "
             "(`sn.ops.registry.all_ops()`), each defined once, in the module of its kind in `stepnet/ops/`; "
             "[adding-an-op.md](adding-an-op.md) says how to add one. *kind*: how the backends "
             "compile it (`elementwise` ops fuse into one loop; `segment` ops reduce each batch "
             "row's own rows of a ragged value). *operands*: how many (`any`: variadic). "
             "*gradient*: whether it has a gradient rule. *ONNX export*: the ONNX operator it "
             "exports as, or `nodes` where it exports as a few nodes.", "",
             "## Primitives", "",
             "| op | kind | operands | gradient | ONNX export | what it computes |",
             "|---|---|---|---|---|---|"]
    for name, op in sorted(registry.all_ops().items()):
        onnx = f"`{op.onnx}`" if isinstance(op.onnx, str) else ("nodes" if op.onnx else "—")
        operands = "any" if op.num_inputs is None else str(op.num_inputs)
        lines.append(f"| `{name}` | {op.kind} | {operands} | {'yes' if op.grad else 'no'} | {onnx} "
                     f"| {_cell(_first_line(op.function.__doc__))} |")
    lines += ["", "## Composites", "",
              "Built from the primitives (`stepnet/ops/composites.py`), so they need no backend "
              "code of their own.", "",
              "| op | what it computes |", "|---|---|"]
    for name in sorted(ops.composites.__all__):
        lines.append(f"| `{name}` | {_cell(_first_line(getattr(ops, name).__doc__))} |")
    return "\n".join(lines) + "\n"


GENERATED = {CLI_PAGE: cli_markdown, OPS_PAGE: ops_markdown}


@pytest.mark.parametrize("path", list(GENERATED), ids=lambda p: str(p.relative_to(ROOT)))
def test_generated_page_is_up_to_date(path):
    expected = GENERATED[path]()
    actual = path.read_text() if path.exists() else ""
    assert actual == expected, f"{path.relative_to(ROOT)} is out of date: {REGENERATE}"


# ---------------------------------------------------------------------------
# the tutorial runs

PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def python_blocks(path: Path) -> list[str]:
    return PYTHON_BLOCK.findall(path.read_text())


def test_getting_started_runs(tmp_path):
    """docs/index.md's ``python`` blocks run, in order, in one namespace, in a
    new process, on the interpreter where a call names no backend."""
    blocks = python_blocks(DOCS / "index.md")
    assert blocks, "docs/index.md has no python block"
    script = "import stepnet\nstepnet.set_default_backend('interpreter')\n" + "\n".join(
        f"# block {i}\n{block}" for i, block in enumerate(blocks, 1))
    env = dict(os.environ, STEPNET_TIERED="0", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"docs/index.md's python blocks fail:\n{result.stderr}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_docs.py --write   (regenerates docs/cli.md and docs/ops.md)")
    sys.path.insert(0, str(ROOT))
    for page, render in GENERATED.items():
        page.write_text(render())
        print(f"wrote {page.relative_to(ROOT)}")
