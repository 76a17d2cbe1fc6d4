"""A venv for a test that sees the packages of the environment running the tests, venv or not.

`python -m venv --system-site-packages` links a new venv to the *base* interpreter's site-packages. Run from an
activated venv (the README's set-up), that is the wrong one: the new venv sees none of the active venv's packages
(torch, pip, setuptools), and a build in it stops with "no torch to build the kernels against". So where the running
interpreter is itself a venv, the new one also gets a .pth file that adds the running venv's site-packages as a
site directory (its own .pth files processed too), ahead of the base's. Torch-free: it runs in any interpreter.
"""
from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "_outer_environment.pth"


def outer_site_dirs() -> list[str]:
    """The running environment's own site-packages where it is a venv; none where it is the base interpreter
    (``--system-site-packages`` already reaches those)."""
    if sys.prefix == sys.base_prefix:
        return []
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def make_venv_seeing_this_environment(dest: Path) -> Path:
    """Creates a venv at `dest` (no pip of its own: it uses this environment's) that imports what this
    environment imports, and returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    outer = outer_site_dirs()
    if outer:
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        lines = "".join(f"import site; site.addsitedir({path!r})\n" for path in outer)
        (Path(purelib) / PTH_NAME).write_text(lines)
    return python
