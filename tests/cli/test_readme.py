"""README.md's commands stay true: CI's two set-up commands come from it, and every `qtrain` command line it
shows parses (a renamed or removed flag fails here, not in a new user's shell)."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from qtrain.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _ci_command(kind: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_commands.py"), kind], check=True,
                           capture_output=True, text=True).stdout.strip()


def test_ci_runs_the_readmes_install_and_test_commands():
    install, tests = _ci_command("install"), _ci_command("test")
    assert f"    {install} && qtrain train\n" in README  # the first command, less the default run
    assert f"    {tests}\n" in README
    assert '-e ".[test]"' in install and "triton==" in install  # the interpreter tests' Triton comes with it
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "readme_commands.py install" in ci and "readme_commands.py test" in ci


def _qtrain_lines() -> list[str]:
    """The `qtrain ...` lines of README's indented code blocks, continuation lines joined, comments cut."""
    lines, out = README.splitlines(), []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("    qtrain "):
            cmd = line.strip()
            while cmd.endswith("\\"):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            out.append(cmd.split("   #")[0])
        i += 1
    return out


@pytest.mark.parametrize("line", _qtrain_lines())
def test_readme_qtrain_command_lines_parse(line):
    argv = shlex.split(line)[1:]
    ns = build_parser().parse_args(argv)  # exits (SystemExit) on an unknown or malformed flag
    assert ns.command == argv[0]
