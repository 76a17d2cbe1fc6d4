"""The documentation cannot rot: the site builds strict, every Python example runs, every `pipeoptim` command parses.

- `mkdocs build --strict` (mkdocs.yml at the root) fails on a broken link, a missing anchor, a page left out of
  the nav or an API reference whose object no longer exists.
- Every block fenced ```python in README.md and docs/ runs on the CPU, each in a fresh namespace, from the repo
  root. A block that cannot run here (it needs torchrun, a GPU, or is a fragment) is fenced ```py instead and
  says why in a comment line starting "# not run"; a test checks that it does.
- Every line of a ```bash block (and of an indented block) that runs `pipeoptim ...` or `python -m pipeoptim.cli
  ...` is parsed by the real argument parser (`pipeoptim.cli.build_parser`), without running anything.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", re.M | re.S)


def _blocks(page: Path, languages: set[str]) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block on the page whose language tag is one of `languages`."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)
            if m.group(1) in languages]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


PYTHON_PAGES = [p for p in PAGES if _blocks(p, {"python"})]


def test_the_site_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip('mkdocs is not installed: pip install mkdocs mkdocs-material "mkdocstrings[python]" '
                    "(scripts/install.sh installs it)")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "site" / "reference" / "pipeline" / "index.html").read_text().count("train_step") > 0, \
        "the API reference lost Pipeline.train_step"


def test_the_docs_have_python_examples():
    # the examples below are found by their fence; a renamed tag would silently test nothing
    assert ROOT / "README.md" in PYTHON_PAGES and len(PYTHON_PAGES) >= 5, PYTHON_PAGES


RUNNER = textwrap.dedent("""
    import sys, traceback
    blocks = {blocks!r}
    for line, code in blocks:
        try:
            exec(compile(code, f"{page}:{{line}}", "exec"), {{"__name__": "__docs_example__"}})
        except BaseException:
            traceback.print_exc()
            sys.exit(f"the example at {page}:{{line}} failed")
    """)


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_name)
def test_every_python_example_runs(page, tmp_path):
    blocks = _blocks(page, {"python"})
    code = RUNNER.format(blocks=blocks, page=_name(page))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PIPEOPTIM_DOCS_EXAMPLE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"


def test_examples_not_run_say_why():
    for page in PAGES:
        for line, code in _blocks(page, {"py"}):
            assert re.search(r"^# not run\b", code, re.M), \
                f"{_name(page)}:{line}: a ```py block is not run by the tests; say why in a '# not run: ...' line"


def _shell_lines(page: Path) -> list[tuple[int, str]]:
    """Each command of the page's shell examples (continuation lines joined), with its block's line."""
    found = []
    for line, code in _blocks(page, {"bash", "sh", "shell", "console"}):
        for command in code.replace("\\\n", " ").splitlines():
            found.append((line, command.strip().removeprefix("$ ")))
    return found


def _pipeoptim_arguments(command: str) -> list[str] | None:
    """The arguments given to the `pipeoptim` command on a shell line, or None where it runs none."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    for i, word in enumerate(words):
        if word == "pipeoptim" and (i == 0 or words[i - 1] in {"&&", ";", "|", "exec"}):
            return words[i + 1:]
        if word == "pipeoptim.cli" and i > 0 and words[i - 1] == "-m":
            return words[i + 1:]
    return None


SHELL_COMMANDS = [(page, line, command) for page in PAGES for line, command in _shell_lines(page)
                  if _pipeoptim_arguments(command) is not None]


def test_the_docs_show_pipeoptim_commands():
    assert len(SHELL_COMMANDS) >= 10, SHELL_COMMANDS


@pytest.mark.parametrize("page,line,command", SHELL_COMMANDS,
                         ids=[f"{_name(p)}:{n}:{c[:40]}" for p, n, c in SHELL_COMMANDS])
def test_every_pipeoptim_command_parses(page, line, command, capsys):
    from pipeoptim.cli import build_parser

    arguments = _pipeoptim_arguments(command)
    for i, word in enumerate(arguments):  # what follows a shell operator is another command
        if word in {"&&", ";", "|", "||"}:
            arguments = arguments[:i]
            break
    try:
        build_parser().parse_args(arguments)
    except SystemExit as stop:  # argparse exits 0 after --help and 2 on an error
        assert stop.code == 0, f"{_name(page)}:{line}: `{command}` does not parse: {capsys.readouterr().err}"


def test_the_parser_check_catches_a_bad_command():
    """The check above can fail: a flag that does not exist is refused."""
    from pipeoptim.cli import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(_pipeoptim_arguments("pipeoptim train --no-such-flag 3"))
    assert stop.value.code == 2
