"""Build llama-job, the package beside this file, into one zipapp (PEP 441): the file that
provisioning installs on every node as /usr/local/sbin/llama-job.

    python build.py --out DIR       prints {"path": ..., "sha256": ..., "changed": bool}

Deterministic: the same sources give the same bytes (entries sorted, one fixed timestamp and
mode), so the file is named by its digest and a second build changes nothing. The archive holds
the package as `llama_cluster/llama_job/` and a `__main__.py` that runs its command line: the
same relative imports hold in the collection and in the archive. Stdlib only, so the node's
python3 (3.10 or newer) runs it. This file is the build, not part of the archive.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
INTERPRETER = b"#!/usr/bin/env python3\n"
MAIN = b"import sys\n\nfrom llama_cluster.llama_job.cli import main\n\nsys.exit(main())\n"
PACKAGE = b'"""llama-job, as the zipapp carries it."""\n'
STAMP = (2026, 1, 1, 0, 0, 0)


def sources(root: Path = HERE) -> list[Path]:
    """The package's modules, in the archive's order."""
    return sorted(p for p in root.glob("*.py") if p.name != "build.py")


def archive(root: Path = HERE) -> bytes:
    """The zipapp's bytes."""
    entries = [("__main__.py", MAIN), ("llama_cluster/__init__.py", PACKAGE)]
    entries += [(f"llama_cluster/llama_job/{p.name}", p.read_bytes()) for p in sources(root)]
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, content in entries:
            info = zipfile.ZipInfo(name, STAMP)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            bundle.writestr(info, content)
    return INTERPRETER + data.getvalue()


def build(out: Path) -> dict[str, object]:
    """Write the zipapp under `out` (named by its digest) unless it is there already."""
    content = archive()
    digest = hashlib.sha256(content).hexdigest()
    target = out / f"llama-job-{digest[:16]}.pyz"
    changed = not (target.is_file() and target.read_bytes() == content)
    if changed:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{target.name}.{os.getpid()}.tmp"
        tmp.write_bytes(content)
        tmp.chmod(0o755)
        os.replace(tmp, target)
    return {"path": str(target), "sha256": digest, "changed": changed}


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    top = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    top.add_argument("--out", required=True, type=Path, help="directory of the built file")
    args = top.parse_args(argv)
    sys.stdout.write(json.dumps(build(args.out)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
