"""Window counts from 5-minute SLI buckets plus raw rows equal a brute-force count over the rows: with nothing
built, part built, all built, and after late spans changed a closed hour (before and after its rebuild); for windows
that end on a whole minute and 17 s into one.

Runs tests/slo/slo_window_check.py in its own process: chdb opens one data directory per process."""
import subprocess
import sys
from pathlib import Path


def test_window_counts_match_brute_force_through_builds_and_late_data():
    script = Path(__file__).with_name("slo_window_check.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "OK nothing built, all from raw rows", "OK one batch built", "OK all built", "OK late data, not rebuilt yet",
        "OK late data, rebuilt",
    ], result.stdout
    assert "(0 dirty" in lines[2] and "(0 dirty" in lines[4]
