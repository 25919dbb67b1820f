"""Each planted mutant of the guard, the checks and the failed-step contract
(``tests/mutants.py``) makes at least one of the tests named for it fail (exit status 1:
a renamed test, which pytest cannot collect, fails this too). The named tests pass unmutated
in the main run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mutants import MUTANTS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_planted_mutant_is_killed(name):
    what, nodes = MUTANTS[name]
    env = dict(os.environ, FGD_FAST_MUTANT=name)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-k", "not triton", *nodes],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1, f"mutant {name!r} ({what}) survived {nodes}:\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
