"""The lint configuration in pyproject.toml ([tool.ruff]) holds for the whole tree."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff():
    exe = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (it comes with the `test` extra)")
    return exe


def test_ruff_check_passes():
    out = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise", ROOT],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_finds_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return undefined_name\n")
    out = subprocess.run([_ruff(), "check", "--no-cache", "--config", os.path.join(ROOT, "pyproject.toml"),
                          str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "F821" in out.stdout
