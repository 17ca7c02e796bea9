"""README.md stays a runnable user guide: every ```python block runs on its own (fresh
namespace: its own imports and inputs), the training command parses with the command's
own argument parser (its run with tiny settings is tests/test_train.py::
test_train_command_and_compare), the install and test markers CI reads are in place,
and the file is under 15,000 characters."""
import os
import re
import shlex

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MAX_CHARS = 15_000


def _text() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def _blocks(lang: str) -> list:
    """(first line number, code) of every fenced block whose info string is `lang`."""
    out, text = [], _text()
    for m in re.finditer(r"^```" + re.escape(lang) + r"\n(.*?)^```", text, re.S | re.M):
        out.append((text.count("\n", 0, m.start()) + 2, m.group(1)))
    return out


PYTHON_BLOCKS = _blocks("python")
SHELL_LINES = [line for _, block in _blocks("") for line in block.splitlines() if line.strip()]


def test_readme_is_short():
    n = len(_text())
    assert n < MAX_CHARS, f"README.md has {n} characters, the limit is {MAX_CHARS}"


def test_readme_has_python_blocks():
    assert len(PYTHON_BLOCKS) >= 5, f"README.md has {len(PYTHON_BLOCKS)} python blocks"


@pytest.mark.parametrize("line,code", PYTHON_BLOCKS, ids=[f"line{line}" for line, _ in PYTHON_BLOCKS])
def test_python_block_runs(line, code):
    namespace = {"__name__": f"readme_line{line}"}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)  # raises on any failure


def _marked_command(marker: str) -> str:
    """The line two below `marker`, as .ci/run reads it."""
    lines = _text().splitlines()
    i = lines.index(marker)
    assert lines[i + 1].startswith("```"), f"{marker} must be followed by a fenced block"
    return lines[i + 2]


def test_ci_markers():
    assert _marked_command("<!-- install -->") == 'pip install -e ".[test]"'
    assert _marked_command("<!-- test -->") == "python -m pytest -q -n 2 tests"


def test_training_command_parses():
    from flax_models import train

    commands = [shlex.split(line) for line in SHELL_LINES if "-m flax_models.train" in line]
    assert commands, "README.md shows no training command"
    for argv in commands:
        assert argv[:3] == ["python", "-m", "flax_models.train"], argv
        args = train.parse_args(argv[3:])
        train.config_from(args)  # the preset and sizes resolve
