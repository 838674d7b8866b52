"""Jinja filters for filling the node environment: the installer's command line, the pins a
wheelhouse can satisfy, and the lock's hashes (which the wheelhouse's files must match).

Runs on the controller. python_env's install.yml builds one command with them, for uv or pip.
The lock (requirements/node-py*.txt, scripts/lock-node-env.py) is a requirements text as uv
writes it: each pin, then its `--hash=sha256:...` options on continuation lines; the source of a
package the wheelhouse builds is recorded in a header line `# sdist <pin> --hash=sha256:...`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import PurePath
from typing import Any

from ansible.errors import AnsibleFilterError

INSTALLERS = ("uv", "pip")
HASH_RE = re.compile(r"--hash=sha256:([0-9a-f]{64})")
SDIST_PREFIX = "# sdist "


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


def _entries(lines: str | Iterable[str], comments: bool = False) -> list[tuple[str, list[str]]]:
    """Each pin of a lock (its text, or a list of lines) with its sha256 hashes; with
    `comments`, the pins of its `# sdist` lines instead."""
    text = lines if isinstance(lines, str) else "\n".join(str(line) for line in lines)
    found = []
    for raw in text.replace("\\\n", " ").splitlines():
        if comments:
            line = raw.removeprefix(SDIST_PREFIX).strip() if raw.startswith(SDIST_PREFIX) else ""
        else:
            line = raw.split("#", 1)[0].strip()
        if line:
            # A build's local version (2.11.0+cu128) is its version, as wheel_pins reads it.
            name, _, version = line.split()[0].partition("==")
            found.append((f"{_name(name)}=={version.split('+')[0]}", HASH_RE.findall(line)))
    return found


def lock_pins(lines: str | Iterable[str]) -> list[str]:
    """The 'name==version' pins of a lock file (its text, or a list of lines), names
    normalised, without their hashes."""
    return [pin for pin, _ in _entries(lines)]


def lock_requirements(lock_text: str, packages: Iterable[str]) -> str:
    """A requirements text of `packages` (pins), each with the lock's hashes: what pip installs
    in its hash-checking mode (--require-hashes), which needs every package of the install to
    carry its hashes. AnsibleFilterError for a pin the lock has no hash for."""
    hashes = dict(_entries(lock_text))
    lines, missing = [], []
    for pin in lock_pins(list(packages)):
        if not hashes.get(pin):
            missing.append(pin)
            continue
        lines.append(pin + "".join(f" --hash=sha256:{h}" for h in hashes[pin]))
    if missing:
        raise AnsibleFilterError(
            f"The lock has no hash for {', '.join(missing)}: pip's hash-checking install needs "
            "one for every package. Regenerate the locks: scripts/lock-node-env.py"
        )
    return "\n".join(lines) + "\n"


def wheelhouse_hash_problems(files: Iterable[Mapping[str, Any]], lock_text: str) -> list[str]:
    """A problem for each file of a wheelhouse (ansible.builtin.find's files, with their sha256
    `checksum`) whose pin the lock hashes and whose sha256 is none of them: a wheel, or the
    source of a package the wheelhouse builds (`# sdist` lines)."""
    wheels = dict(_entries(lock_text))
    sources = dict(_entries(lock_text, comments=True))
    problems = []
    for found in files:
        base = PurePath(str(found.get("path", ""))).name
        if base.endswith(".whl"):
            (pin,) = wheel_pins([base])
            expected = wheels.get(pin)
        elif base.endswith((".tar.gz", ".zip")):
            stem = base.removesuffix(".tar.gz").removesuffix(".zip")
            name, _, version = stem.rpartition("-")
            pin = f"{_name(name)}=={version}"
            expected = sources.get(pin)
        else:
            continue
        checksum = str(found.get("checksum") or "")
        if expected and checksum not in expected:
            problems.append(
                f"{found.get('path')}: sha256 {checksum or 'unknown'} is none of the "
                f"{len(expected)} the lock records for {pin}"
            )
    return problems


def carried_pins(lock_text: str, files: Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    """The lock's pins that the wheelhouse files satisfy, but the names in exclude: what an
    overlay install adds to an existing environment."""
    have = set(wheel_pins(files))
    skip = {_name(e) for e in exclude}
    return [p for p in lock_pins(lock_text) if p in have and _name(p) not in skip]


def _source_args(spec: Mapping[str, Any]) -> list[str]:
    """Where the installer takes the packages from: the wheelhouse alone, or the indexes."""
    wheelhouse = spec.get("wheelhouse") or ""
    index_urls = [str(u) for u in spec.get("index_urls") or []]
    if wheelhouse:
        return ["--no-index", "--find-links", str(wheelhouse)]
    if len(index_urls) != 1:
        raise AnsibleFilterError(
            "install_argv needs a wheelhouse directory or exactly one index: each install comes "
            f"from one named index (got {index_urls})."
        )
    return ["--index-url", index_urls[0]]


def install_argv(packages: Iterable[str], spec: Mapping[str, Any]) -> list[str]:
    """The command that installs packages into the environment under the lock.

    spec: installer (uv | pip), env_bin, constraints (a file; uv checks the hashes it holds),
    wheelhouse (a directory: no index at all) or index_urls (one index: a second is refused, so
    that no package can come from an index other than its own), no_deps (bool), dry_run (bool:
    say what would change and change nothing, the plan's check mode), requirements (a file of
    pins with their hashes, installed in hash-checking mode, --require-hashes: every package of
    the install must be in it).
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
    argv += _source_args(spec)
    if spec.get("constraints"):
        argv += ["--constraint", str(spec["constraints"])]
    if spec.get("requirements"):
        argv += ["--require-hashes", "--requirement", str(spec["requirements"])]
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
    if not packages and not spec.get("requirements"):
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
            "lock_requirements": lock_requirements,
            "wheelhouse_hash_problems": wheelhouse_hash_problems,
            "carried_pins": carried_pins,
            "install_argv": install_argv,
            "installer_changed": installer_changed,
        }
