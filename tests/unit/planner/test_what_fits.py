"""docs/performance.md's "What fits on your card" is what the planner plans (its script)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _script() -> object:
    spec = importlib.util.spec_from_file_location("what_fits", ROOT / "scripts" / "what-fits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_table_is_the_planners() -> None:
    fits = _script()
    text = fits.DOC.read_text()
    assert fits.with_table(text, fits.table()) == text, "run scripts/what-fits.py --write"


def test_the_table_covers_every_card_size_and_fine_tuning() -> None:
    table = _script().table()
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    assert len(rows) == 4 * 3  # 1.5B, 4B, 8B, 14B x full, LoRA, QLoRA
    assert all(line.count(" | ") == 5 for line in rows)
    assert "8-bit AdamW" in table
    assert "QLoRA 4-bit" in table
    assert "measured " in table
