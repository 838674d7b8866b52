"""Runs each molecule scenario (real containers on the lab node image) as one test.

Each scenario is an xdist group of its own (`make test` runs the suite with `--dist loadgroup`):
its containers, network and ephemeral directory are named after it, so scenarios run side by
side; tests/conftest.py starts the longest first.

A scenario passes when molecule does and its verify's own pytest (molecule/<scenario>/tests, in
.cache/molecule-<scenario>.log) ran tests and skipped none: a skipped inner test (a run that
did not complete, a variable molecule did not set) would otherwise count as passed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p.parent.name for p in (ROOT / "molecule").glob("*/molecule.yml"))
# pytest's last line: "===== 12 passed, 2 skipped, 1 warning in 33.21s (0:00:33) =====".
SUMMARY = re.compile(
    r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in [0-9.]+s(?: \([0-9:]+\))?\s*=*\s*$", re.MULTILINE
)
# Its short summary's skips (-ra, pyproject.toml): "SKIPPED [1] path:line: reason".
SKIPPED = re.compile(r"^SKIPPED \[\d+\] .*$", re.MULTILINE)


def inner_summary(log: str) -> dict[str, int] | None:
    """The counts of the last pytest summary line of a scenario's log (passed, skipped, failed,
    ... with plural forms made singular), or None where pytest printed none."""
    found = SUMMARY.findall(log)
    if not found:
        return None
    counts = {}
    for part in found[-1].split(", "):
        number, word = part.split(" ")
        counts[word.removesuffix("s") if word in ("errors", "warnings") else word] = int(number)
    return counts


def inner_problem(log: str) -> str | None:
    """Why a scenario whose molecule run passed does not count as passed: its verify ran no
    tests, or skipped some (each named with its reason); None when every test ran and passed."""
    counts = inner_summary(log)
    if counts is None or not counts.get("passed"):
        return "its verify ran no tests (no pytest summary with passed tests in its log)"
    if counts.get("skipped"):
        skips = "\n".join(SKIPPED.findall(log)) or "(the log names none: run with -ra)"
        return f"its verify skipped {counts['skipped']} test(s), which count as not run:\n{skips}"
    return None


@pytest.mark.molecule
@pytest.mark.parametrize(
    "scenario",
    [pytest.param(s, marks=pytest.mark.xdist_group(f"molecule-{s}")) for s in SCENARIOS],
)
def test_molecule_scenario_passes(scenario: str) -> None:
    """`molecule test -s <scenario>`: create, converge, idempotence, verify, destroy."""
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed")
    molecule = Path(sys.executable).with_name("molecule")
    log = ROOT / ".cache" / f"molecule-{scenario}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.run(
            [str(molecule), "test", "-s", scenario],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "ANSIBLE_FORCE_COLOR": "0", "PY_COLORS": "0"},
            check=False,
        )
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        tail = text.splitlines()[-150:]
        pytest.fail(f"molecule test -s {scenario} failed (full log: {log}):\n" + "\n".join(tail))
    problem = inner_problem(text)
    if problem:
        pytest.fail(f"molecule test -s {scenario} passed, but {problem}\n(full log: {log})")


# ---- the inner summary, read from logs as pytest writes them ----------------------------------
@pytest.mark.parametrize(
    ("log", "counts", "problem"),
    [
        ("=== 12 passed in 33.21s ===\n", {"passed": 12}, None),
        (
            "collected 14 items\n...\n=========================== short test summary info ===\n"
            "SKIPPED [1] molecule/train/tests/test_bad_input.py:130: the skip-invalid run did not "
            "complete\n"
            "==== 12 passed, 2 skipped, 3 warnings in 1203.50s (0:20:03) ====\n"
            "INFO     Verifier completed successfully.\n",
            {"passed": 12, "skipped": 2, "warning": 3},
            "its verify skipped 2 test(s), which count as not run:\nSKIPPED [1] "
            "molecule/train/tests/test_bad_input.py:130: the skip-invalid run did not complete",
        ),
        ("1 passed, 1 skipped in 0.5s\n", {"passed": 1, "skipped": 1}, "skipped 1 test(s)"),
        ("===== no tests ran in 0.01s =====\n", None, "ran no tests"),
        ("INFO     Verifier completed successfully.\n", None, "ran no tests"),
        ("==== 3 deselected in 0.02s ====\n", {"deselected": 3}, "ran no tests"),
    ],
)
def test_a_scenario_counts_as_passed_only_when_its_inner_tests_all_ran(
    log: str, counts: dict | None, problem: str | None
) -> None:
    assert inner_summary(log) == counts
    found = inner_problem(log)
    assert (found is None) == (problem is None), found
    if problem:
        assert problem in found
