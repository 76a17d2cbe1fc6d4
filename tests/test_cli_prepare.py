"""`pipeoptim prepare-data` (pipeoptim/cli/prepare.py): a text file becomes a prepared folder that `train --data`
takes, said in one line; bad input is exit status 2 with a message naming the fix and nothing written."""
from __future__ import annotations

import json
import subprocess
import sys

from pipeoptim.cli import main


def test_prepare_data_writes_a_folder_and_says_what_it_holds(tmp_path, capsys):
    src = tmp_path / "t.txt"
    src.write_text("print('hello')\n" * 500)
    assert main(["prepare-data", str(src), str(tmp_path / "p"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "with 1 worker(s)" in out, out  # bytes: one worker unless asked (more only add their start)
    assert "7,125 training and 375 held-out tokens of bytes (vocabulary 256, uint16)" in out, out
    assert f"pipeoptim train --data {tmp_path / 'p'}" in out
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["tokens"] == 7125 and manifest["source"]["path"] == str(src)
    assert main(["prepare-data", str(src), str(tmp_path / "p"), "--no-progress"]) == 2
    assert "exists and is not empty: give --overwrite" in capsys.readouterr().err
    assert main(["prepare-data", str(tmp_path / "none"), str(tmp_path / "q"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "q").exists()


def test_the_help_names_the_sources_and_loads_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys; from pipeoptim.cli import main\n"
                          "try:\n    main(['prepare-data', '--help'])\nexcept SystemExit:\n    pass\n"
                          "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert "--text-field" in out.stdout and "save_to_disk" in out.stdout and "--workers" in out.stdout
    assert out.stdout.strip().endswith("False"), out.stdout
