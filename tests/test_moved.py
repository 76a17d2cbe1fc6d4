"""The old import paths of moved modules (pipeoptim/_moved.py, and the CLI's pipeoptim.cli_* files) still import,
as the very module at the new path, with a DeprecationWarning that names the new path; nothing here uses them."""
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeoptim._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
OLD_CLI = {"pipeoptim.cli_train": "pipeoptim.cli.train", "pipeoptim.cli_torchrun": "pipeoptim.job.torchrun",
           "pipeoptim.cli_prepare": "pipeoptim.cli.prepare"}

# run in a new interpreter, where nothing is imported yet: each old path imported twice (as a module, then as a
# name of its parent, by import statements) and the new one once, with every warning recorded
_IMPORT_EACH = r"""
import importlib, json, sys, warnings
out = {}
for old, new in json.loads(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        parent, _, leaf = old.rpartition(".")
        space = {}
        exec(f"import {old} as a\nfrom {parent} import {leaf} as b", space)   # as a user's code would
        a, b = space["a"], space["b"]
        c = importlib.import_module(new) if new else a
    out[old] = {"same": a is b is c, "name": a.__name__,
                "warnings": [f"{w.category.__name__}: {w.message}" for w in seen
                             if issubclass(w.category, DeprecationWarning)],
                "where": [w.filename for w in seen if issubclass(w.category, DeprecationWarning)]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def imported() -> dict:
    names = {**MOVED, **{old: "" for old in OLD_CLI}}
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, json.dumps(names)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_old_path_is_the_new_module_with_one_warning_naming_it(imported):
    for old, new in MOVED.items():
        got = imported[old]
        assert got["same"] and got["name"] == new, (old, got)
        # once per process however often it is imported, and pointing at the importing line, not importlib's
        assert got["warnings"] == [f"DeprecationWarning: {old} moved to {new}: import it from there"], (old, got)
        assert got["where"] == ["<string>"], (old, got)


def test_the_clis_old_module_paths_import_with_a_warning(imported):
    for old, new in OLD_CLI.items():
        assert imported[old]["warnings"] == [f"DeprecationWarning: {old} is deprecated: import {new} instead"], \
            (old, imported[old])


def test_a_patch_through_the_old_path_reaches_the_new_module(monkeypatch):
    new = importlib.import_module(MOVED["pipeoptim.predictor"])
    with pytest.warns(DeprecationWarning):
        sys.modules.pop("pipeoptim.predictor", None)
        old = importlib.import_module("pipeoptim.predictor")
    monkeypatch.setattr(old, "_can_swap", lambda: "patched")
    assert new._can_swap() == "patched"


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
