"""Jinja filters for filling the node environment: the installer's command line and the pins a
wheelhouse can satisfy.

Runs on the controller. python_env's install.yml builds one command with them, for uv or pip.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import PurePath
from typing import Any

from ansible.errors import AnsibleFilterError

INSTALLERS = ("uv", "pip")


def _name(requirement: str) -> str:
    """The PEP 503 name of 'name==version' (or of a bare name)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0]).lower()


def wheel_pins(files: Iterable[str]) -> list[str]:
    """'name==version' for each wheel file name (PEP 503 names, local versions such as +cu128
    dropped), sorted: what a wheelhouse holds."""
    pins = set()
    for path in files:
        base = PurePath(str(path)).name
        if not base.endswith(".whl"):
            continue
        name, version = base.split("-")[:2]
        pins.add(f"{_name(name)}=={version.split('+')[0]}")
    return sorted(pins)


def lock_pins(lines: str | Iterable[str]) -> list[str]:
    """The 'name==version' lines of a lock file (its text, or a list of lines), names normalised."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    pins = []
    for raw in lines:
        line = str(raw).split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins.append(f"{_name(name)}=={version.strip()}")
    return pins


def carried_pins(lock_text: str, files: Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    """The lock's pins that the wheelhouse files satisfy, but the names in exclude: what an
    overlay install adds to an existing environment."""
    have = set(wheel_pins(files))
    skip = {_name(e) for e in exclude}
    return [p for p in lock_pins(lock_text) if p in have and _name(p) not in skip]


def install_argv(packages: Iterable[str], spec: Mapping[str, Any]) -> list[str]:
    """The command that installs packages into the environment under the lock.

    spec: installer (uv | pip), env_bin, constraints, wheelhouse (a directory: no index at all)
    or index_urls (the first is the main index, the others extra), no_deps (bool), dry_run
    (bool: say what would change and change nothing, the plan's check mode).
    """
    installer = spec.get("installer")
    if installer not in INSTALLERS:
        raise AnsibleFilterError(
            f"python_env_installer is {installer!r}; it must be one of {', '.join(INSTALLERS)}."
        )
    env_bin = str(spec["env_bin"])
    if installer == "uv":
        argv = [f"{env_bin}/uv", "pip", "install", "--python", f"{env_bin}/python"]
    else:
        argv = [f"{env_bin}/python", "-m", "pip", "install", "--disable-pip-version-check"]
    wheelhouse = spec.get("wheelhouse") or ""
    index_urls = [str(u) for u in spec.get("index_urls") or []]
    if wheelhouse:
        argv += ["--no-index", "--find-links", str(wheelhouse)]
    elif index_urls:
        argv += ["--index-url", index_urls[0]]
        for url in index_urls[1:]:
            argv += ["--extra-index-url", url]
        if installer == "uv" and len(index_urls) > 1:
            # pip's rule: the best version across every index (uv's default stops at the first
            # index that has the package, e.g. torch's index for filelock).
            argv += ["--index-strategy", "unsafe-best-match"]
    else:
        raise AnsibleFilterError("install_argv needs a wheelhouse directory or index_urls.")
    argv += ["--constraint", str(spec["constraints"])]
    if spec.get("no_deps"):
        argv.append("--no-deps")
    if spec.get("dry_run"):
        argv.append("--dry-run")
    elif installer == "uv":
        # Bytecode at install, as pip does: the environment belongs to root and the job's user
        # cannot write __pycache__, so without it every rank of every launch compiles the stack
        # from source (importing LLaMA-Factory's trainer: 32 s of CPU, 13 s from bytecode).
        argv.append("--compile-bytecode")
    packages = [str(p) for p in packages]
    if not packages:
        raise AnsibleFilterError("install_argv was given no packages to install.")
    return argv + packages


def installer_changed(result: Mapping[str, Any], installer: str) -> bool:
    """Whether an install run (its stdout/stderr) changed the environment, or a dry run would."""
    out = f"{result.get('stdout', '')}\n{result.get('stderr', '')}"
    if installer == "uv":
        pattern = r"^(Installed|Uninstalled|Would install|Would uninstall) \d+ package"
        return re.search(pattern, out, re.M) is not None
    return re.search(r"^(Successfully installed|Would install) ", out, re.M) is not None


class FilterModule:
    """Filters for the node environment."""

    def filters(self) -> dict[str, Any]:
        """Filter names."""
        return {
            "wheel_pins": wheel_pins,
            "lock_pins": lock_pins,
            "carried_pins": carried_pins,
            "install_argv": install_argv,
            "installer_changed": installer_changed,
        }
