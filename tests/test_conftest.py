"""tests/conftest.py's hooks beyond the tiers (test_testing.py and the tier rules cover those)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_test_times_are_written_as_tests_finish(tmp_path):
    """PAGED_BACKEND_TEST_TIMES: a line per test call (duration, phase, outcome, id), appended as each
    finishes - what a GPU run cut short still tells (tests/gpu/run.sh sets it)."""
    times = tmp_path / "times.txt"
    env = {**os.environ, "PAGED_BACKEND_TEST_TIMES": str(times)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                        "tests/test_host_tables.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:]
    lines = times.read_text().splitlines()
    assert len(lines) == 1 and lines[0].split()[1:3] == ["call", "passed"], lines
    assert lines[0].endswith("tests/test_host_tables.py::test_rows_by_slot_as_the_last_step_left_them[cpu]")
    assert float(lines[0].split()[0]) >= 0
