#!/usr/bin/env python3
"""Time and peak memory of the dataset check (module_utils/dataset_check.py) on a large file.

Writes a sharegpt file of about --gib GiB (a JSON list, or JSON Lines with --jsonl), with one bad
record in 100,000, then checks it in a child process, as the Ansible module runs, and prints the
wall time, throughput and the child's peak resident memory. Not a test: run it by hand.

    python bench/dataset_check.py --gib 1 [--jsonl] [--dir /tmp] [--keep]
    python bench/dataset_check.py --gib 1 --valid --write-only --dir /tmp   (a file to train on)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1] + "/collections")
from ansible_collections.llama.cluster.plugins.module_utils import dataset_check as check
spec = check.build_spec("sharegpt")
started = time.monotonic()
report = check.check_file(sys.argv[2], spec)
print(json.dumps({"seconds": time.monotonic() - started, "records": report.records,
                  "valid": report.valid, "invalid": report.invalid, "errors": report.errors[:2]}))
"""


def _record(rng: random.Random, number: int, bad_every: int = 100_000) -> dict:
    """A conversation of 1-3 exchanges with texts of a few hundred characters."""
    words = ["cluster", "gradient", "node", "rank", "token", "batch", "epoch", "checkpoint"]
    messages = []
    for _ in range(rng.randint(1, 3)):
        for role in ("human", "gpt"):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(10, 80)))
            messages.append({"from": role, "value": f"{number}: {text}"})
    if bad_every and number % bad_every == bad_every - 1:
        messages[-1]["from"] = "robot"
    return {"conversations": messages}


def write(path: Path, size: int, jsonl: bool, valid: bool = False) -> int:
    """Write records until the file holds size bytes; returns the record count.

    Cycles through 1,000 different records (serialising each of millions is slower than the
    check); one record in 100,000 is bad, unless `valid`.
    """
    rng = random.Random(1)
    pool = [json.dumps(_record(rng, n), ensure_ascii=False) for n in range(1000)]
    bad = json.dumps(_record(rng, 99_999), ensure_ascii=False)
    count = 0
    with path.open("w", encoding="utf-8") as out:
        out.write("" if jsonl else "[\n")
        while out.tell() < size:
            text = bad if count % 100_000 == 99_999 and not valid else pool[count % 1000]
            out.write(text + "\n" if jsonl else ("" if count == 0 else ",\n") + text)
            count += 1
        out.write("" if jsonl else "\n]\n")
    return count


def main() -> int:
    """Generate, check, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--jsonl", action="store_true")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--valid", action="store_true", help="no bad record")
    parser.add_argument("--write-only", action="store_true", help="write the file and keep it")
    args = parser.parse_args()
    path = Path(args.dir) / f"bench-dataset.{'jsonl' if args.jsonl else 'json'}"
    started = time.monotonic()
    count = write(path, int(args.gib * (1 << 30)), args.jsonl, args.valid)
    size = path.stat().st_size
    print(f"wrote {path}: {size / (1 << 30):.2f} GiB, {count} records in "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    if args.write_only:
        return 0
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(ROOT), str(path)],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        if not args.keep:
            path.unlink()
    result = json.loads(done.stdout)
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(
        f"checked {result['records']} records ({result['invalid']} invalid) in "
        f"{result['seconds']:.1f} s = {size / (1 << 20) / result['seconds']:.0f} MiB/s; "
        f"peak resident memory {peak_mib:.0f} MiB; first error: {result['errors'][:1]}"
    )
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
