"""README.md stays a runnable user guide: every ```python block runs on its own (fresh
namespace: its own imports and inputs), the training command parses with the command's
own argument parser (its run with tiny settings is tests/test_train.py::
test_train_command_and_compare), the install and test markers CI reads are in place,
and the file is under 15,000 characters."""
import os
import shlex

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MAX_CHARS = 15_000


def _text() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def _blocks(lang: str) -> list:
    """(first line number, code) of every fenced block whose info string is `lang`."""
    out, block, info = [], None, None
    for number, line in enumerate(_text().splitlines(), 1):
        if block is None and line.startswith("```"):
            block, info, start = [], line[3:].strip(), number + 1
        elif block is not None and line.strip() == "```":
            if info == lang:
                out.append((start, "\n".join(block) + "\n"))
            block = None
        elif block is not None:
            block.append(line)
    assert block is None, "README.md has an unclosed code fence"
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


def test_results_table_comes_from_the_history(capsys):
    """The README's results table is `python -m bench.report models --run RUN`'s output for
    the run it names, read from bench/results/results.csv (no figure typed by hand)."""
    from bench import report

    commands = [shlex.split(line) for line in SHELL_LINES if "-m bench.report models" in line]
    assert len(commands) == 1, f"README.md should show one results command, found {commands}"
    argv = commands[0]
    assert argv[:3] == ["python", "-m", "bench.report"] and "latest" not in argv, argv
    report.main(argv[3:])
    table = capsys.readouterr().out.strip()
    assert table.count("\n") >= 4 and table in _text(), "README.md's table differs from the report's output"
