"""The old import paths of moved modules (pipeoptim/_moved.py, and the CLI's pipeoptim.cli_* files) still import,
as the very module at the new path, with a DeprecationWarning that names the new path; nothing here uses them."""
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeoptim._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
OLD_CLI = {"pipeoptim.cli_train": "pipeoptim.cli.train", "pipeoptim.cli_torchrun": "pipeoptim.cli.torchrun",
           "pipeoptim.cli_prepare": "pipeoptim.cli.prepare"}


def _import_fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (so no module is already imported) with every warning shown."""
    done = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_with_a_warning_naming_it(old):
    new = MOVED[old]
    parent, _, leaf = old.rpartition(".")
    out = _import_fresh(f"import {old} as a\nfrom {parent} import {leaf} as b\nimport {new} as c\n"
                        f"print('same', a is b is c, a.__name__)")
    assert f"same True {new}" in out
    assert f"DeprecationWarning: {old} moved to {new}: import it from there" in out
    assert out.count("DeprecationWarning") == 1        # once per process, however many times it is imported


def test_a_patch_through_the_old_path_reaches_the_new_module(monkeypatch):
    new = importlib.import_module(MOVED["pipeoptim.predictor"])
    with pytest.warns(DeprecationWarning):
        sys.modules.pop("pipeoptim.predictor", None)
        old = importlib.import_module("pipeoptim.predictor")
    monkeypatch.setattr(old, "_can_swap", lambda: "patched")
    assert new._can_swap() == "patched"


@pytest.mark.parametrize("old", sorted(OLD_CLI))
def test_the_clis_old_module_paths_import_with_a_warning(old):
    out = _import_fresh(f"import {old}")
    assert f"{old} is deprecated: import {OLD_CLI[old]} instead" in out


def test_the_new_paths_are_used_everywhere_in_the_repository():
    """Only the alias table, this test and the history name an old path: the library, its tests, benchmarks,
    scripts and docs import the new ones (so the warning reaches users' code only)."""
    files = subprocess.run(["git", "ls-files", "pipeoptim", "tests", "benchmarks", "scripts", "docs", "examples",
                            "README.md", "mkdocs.yml"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    mine = {"pipeoptim/_moved.py", "tests/test_moved.py", "docs/architecture.md"}
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, MOVED)) + r")(?!\w)")
    found = []
    for name in files:
        path = ROOT / name
        if name in mine or path.suffix not in (".py", ".md", ".yml", ".sh") or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{name}:{i}: {line.strip()}")
    assert not found, "old module paths (use the new ones, pipeoptim/_moved.py):\n" + "\n".join(found)
