"""Generated files: a generator's `--check` agrees with what the repository holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def generated_check(script: Path, env: dict[str, str] | None = None) -> None:
    """`script --check` (a generator of the repository's files) passes: what it would write is
    what the repository holds."""
    proc = subprocess.run(
        [sys.executable, str(script), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
