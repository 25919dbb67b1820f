"""Each planted mutant of the guard, the checks and the failed-step contract
(``tests/mutants.py``) makes at least one of the tests named for it fail (exit status 1: a
renamed test, which pytest cannot collect, fails this too). All mutants run in one child
interpreter; the named tests pass unmutated in the main run. A mutant that sets a name its
module does not hold (what it patched moved elsewhere, so it patches nothing the code calls)
fails to plant, and so does one planted in the ranks' processes (tried first, and undone, in
the child: in a rank its failure to plant would fail the test and pass for a kill; two such
mutants had been "killed" that way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mutants import MUTANTS

ROOT = Path(__file__).resolve().parent.parent


def test_every_planted_mutant_is_killed(tmp_path):
    out = tmp_path / "status.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "mutants.py"), "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=900,
    )
    status = json.loads(out.read_text()) if out.exists() else {}
    output = run.stdout[-3000:] + run.stderr[-3000:]
    assert status.pop("control", None) == 0, "the named tests fail unmutated:\n" + output
    assert status.keys() == MUTANTS.keys(), output
    survived = {name: MUTANTS[name] for name, code in status.items() if code != 1}
    assert not survived, f"mutants not killed (exit status != 1): {survived}\n{output}"
