#!/usr/bin/env python3
"""Print, as one JSON object, the installed versions of the cluster's Python packages.

Reads package metadata only (nothing is imported), so it takes well under a second and shows
what is installed now, even when the provisioning facts are older.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata


def main() -> int:
    """Print {"python": ..., package: version or null} for the packages named as arguments."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in sys.argv[1:]:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    print(json.dumps(versions, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
