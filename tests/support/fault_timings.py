"""Where the fault tests write what they measured: `.cache/fault_timings.json` (not in git; each
run rewrites the rows it measured), which docs/faults.md's table is read from. Shared by the
molecule train scenario (molecule/train/tests/test_train*.py) and the lab's local-rank faults
(tests/lab/test_lab_ranks.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / ".cache" / "fault_timings.json"
ABOUT = (
    "Written by molecule/train/tests/test_train*.py and tests/lab/test_lab_ranks.py: seconds from "
    "each fault to no training process left on any node still up (2 CPU nodes on one machine), "
    "the bound the test asserts, how it is derived, and the load average when it was measured."
)


def record_fault(name: str, seconds: float, bound: float, derivation: str) -> None:
    """A fault's stop time: printed, written to RESULTS (within its bound or not), asserted."""
    print(f"{name}: every rank stopped {seconds:.1f} s after the fault (bound {bound:.0f} s)")
    try:
        results = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        results = {}
    results["about"] = ABOUT
    results.setdefault("faults", {})[name] = {
        "measured_s": round(seconds, 1),
        "bound_s": round(bound, 1),
        "bound": derivation,
        "within_bound": seconds <= bound,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 1),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    assert seconds <= bound, f"{name}: {seconds:.1f} s > {bound:.0f} s"
