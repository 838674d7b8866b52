"""What roles/nvidia_driver does on a node: keep, install or upgrade the NVIDIA driver, or refuse.

Facts in, action out. `driver_action` reads the node's facts as roles/host_facts records them
(the loaded driver, the module installed on disk, nouveau, Secure Boot, the GPU count), the
minimum driver of the pinned CUDA build, the pinned branch, and what the operator allows; it
returns the action, whether a reboot is needed, one line saying why (naming the versions), and the
message a node stops with when it may not go on.

The policy (the role's README has the table):
- a loaded driver that meets the minimum of the CUDA build is kept, whatever its branch;
- a driver is installed only where none is loaded or the loaded one is older than the minimum;
- a driver installed but not loaded (a reboot pending) needs the reboot, not a reinstall;
- nouveau loaded: blacklist it and install; the driver loads after a reboot;
- Secure Boot enabled and a module to build that no enrolled key signs: blocked;
- no reboot without the operator's consent, and never of the controller itself.

Standard library only (Python 3.10: the nodes' oldest); errors are ValueError naming the fact.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ACTIONS = ("keep", "install", "upgrade", "blocked")
VERSION_RE = re.compile(r"^\d+(\.\d+)*$")


def parse_version(value: object, what: str) -> tuple[int, ...]:
    """'580.95.05' as (580, 95, 5); a Debian package version's revision ('-0+deb12u1') is dropped.

    Raises ValueError naming `what` when the text is not a dotted version.
    """
    text = str(value).strip().split("-", 1)[0]
    if not VERSION_RE.match(text):
        raise ValueError(f"{what} is {value!r}, not a driver version such as 580.95.05")
    return tuple(int(part) for part in text.split("."))


def _text(version: tuple[int, ...]) -> str:
    """(580, 95, 5) as '580.95.05': NVIDIA writes the last two fields with two digits."""
    head, *rest = version
    return ".".join([str(head), *(f"{part:02d}" for part in rest)])


def _optional_version(facts: Mapping[str, Any], key: str) -> tuple[int, ...] | None:
    """A version fact that may be absent (null, '' or missing)."""
    value = facts.get(key)
    if value is None or str(value).strip() == "":
        return None
    return parse_version(value, f"the fact {key}")


def _flag(facts: Mapping[str, Any], key: str) -> bool | None:
    """A boolean fact; None when the probe could not tell (or an older probe did not record it)."""
    value = facts.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"the fact {key} is {value!r}, not true, false or null")


def _node(facts: object) -> dict[str, Any]:
    """The facts the decision reads, checked: ValueError names the first bad one."""
    if not isinstance(facts, Mapping):
        raise ValueError(f"the node's facts are {type(facts).__name__}, not a mapping")
    count = facts.get("gpu_count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"the fact gpu_count is {count!r}, not a number of GPUs")
    loaded = _optional_version(facts, "driver_version")
    if facts.get("driver_loaded") is True and loaded is None:
        raise ValueError("the fact driver_loaded is true but driver_version is empty")
    return {
        "gpu_count": count,
        "loaded": loaded,
        "installed": _optional_version(facts, "driver_installed"),
        "nouveau": bool(_flag(facts, "nouveau_loaded")),
        "secure_boot": _flag(facts, "secure_boot"),
    }


@dataclass(frozen=True)
class _Case:
    """One node's decision in the making: what it runs and what the project pins."""

    host: str
    playbook: str
    pinned: int
    minimum: tuple[int, ...] | None
    target: str
    target_version: tuple[int, ...] | None
    need: str
    new: str

    def meets(self, version: tuple[int, ...] | None) -> bool:
        """Whether a driver version meets the CUDA build's minimum."""
        return version is not None and (self.minimum is None or version >= self.minimum)


def _kept(case: _Case, loaded: tuple[int, ...], installed: tuple[int, ...] | None) -> str:
    """Why a loaded driver that meets the minimum stays, whatever its branch."""
    major = loaded[0]
    if major == case.pinned:
        which = f"of the pinned branch {case.pinned}"
    else:
        relation = "newer" if major > case.pinned else "older"
        which = f"(branch {major}, {relation} than the pinned {case.pinned})"
    reason = f"driver {_text(loaded)} {which} is loaded and meets {case.need}: kept"
    if installed and installed != loaded:
        reason += f" ({_text(installed)} is installed and loads at the node's next reboot)"
    return reason


def _blocked(case: _Case, why: str, secure_boot: bool | None, mok_enrolled: bool) -> dict | None:
    """The refusal when a driver must be installed but cannot be used: None when it can."""
    if case.target_version is not None and not case.meets(case.target_version):
        return {
            "reason": f"{why}, and the pinned driver {case.target} is older than {case.need}",
            "stop": (
                f"{case.host}: {why}, and the driver it would get, {case.target}, is older than"
                f" {case.need}. Pick a cuda_version whose minimum this driver meets (a 12.x build"
                " for branch 535), or a newer branch with nvidia_driver_source: cuda_repo."
            ),
        }
    if secure_boot and not mok_enrolled:
        return {
            "reason": (
                f"{why}; Secure Boot is enabled and the {case.new} module DKMS would build is"
                " signed by no key the firmware trusts"
            ),
            "stop": (
                f"{case.host}: {why}, and Secure Boot is enabled: the {case.new} module that DKMS"
                " would build is signed by no enrolled key, so the kernel would refuse to load"
                " it. Enroll a MOK key for DKMS (mokutil --import, then confirm it at the console"
                " on the next boot) and set nvidia_driver_mok_enrolled: true for"
                f" {case.host}, or disable Secure Boot in its firmware; then run"
                f" {case.playbook} again."
            ),
        }
    return None


def _stop(case: _Case, decision: dict[str, Any], policy: Mapping[str, Any]) -> str:
    """The message a node that needs a reboot stops with before anything changes, or ''."""
    host, playbook = case.host, case.playbook
    if not decision["reboot"]:
        return ""
    if policy["controller"]:
        return (
            f"{host}: {decision['reason']}. {host} is the controller itself, which {playbook}"
            f" never reboots: reboot it by hand, then run {playbook} again."
        )
    if policy["allow_reboot"]:
        return ""
    # Before an install nothing has changed yet; a pending reboot may follow this run's install.
    untouched = f", so nothing was changed on {host}"
    if decision["action"] == "keep":
        untouched = ""
        by_hand = f"or reboot {host} by hand and run {playbook} again"
    elif decision["loaded"]:
        by_hand = f"or install {case.new} and reboot {host} by hand, then run {playbook} again"
        untouched += (
            " (the new driver's libraries beside the loaded module would break the CUDA"
            " programs running on it)"
        )
    else:
        by_hand = f"or blacklist nouveau and reboot {host} by hand, then run {playbook} again"
    sources = "".join(f"-i {source} " for source in policy["inventory"])
    command = f"ansible-playbook {sources}{playbook} -e allow_reboot=true --limit {host}"
    return (
        f"{host}: {decision['reason']}. {playbook} reboots a node only when allowed{untouched}."
        f" Continue with: {command} {by_hand}."
    )


def _decide(case: _Case, node: Mapping[str, Any], mok_enrolled: bool) -> dict[str, Any]:
    """Action, reboot, blacklist_nouveau and reason for a node with GPUs."""
    loaded, installed = node["loaded"], node["installed"]
    if case.meets(loaded):
        return {"action": "keep", "reason": _kept(case, loaded, installed)}

    # Nothing usable runs: something must change on this node.
    if loaded:
        why = f"driver {_text(loaded)} is loaded, older than {case.need}"
    elif node["nouveau"]:
        why = "nouveau is loaded (it holds the GPUs)"
    else:
        why = "no NVIDIA driver is loaded"

    if case.meets(installed):
        return {
            "action": "keep",
            "reboot": True,
            "blacklist_nouveau": node["nouveau"],
            "reason": (
                f"{why}; driver {_text(installed)} is installed but not loaded: a reboot is"
                " pending, no reinstall"
            ),
        }
    blocked = _blocked(case, why, node["secure_boot"], mok_enrolled)
    if blocked:
        return {"action": "blocked", **blocked}
    # A running module (an old driver or nouveau) is only replaced by a reboot; with none
    # running, modprobe loads the new one.
    reboot = bool(loaded) or node["nouveau"]
    old = ""
    if installed and installed != loaded:
        old = f" (driver {_text(installed)} is installed, older than {case.need})"
    load = "then reboot to load it" if reboot else "then load it with modprobe"
    return {
        "action": "upgrade" if loaded or installed else "install",
        "reboot": reboot,
        "blacklist_nouveau": True,
        "reason": f"{why}{old}: install {case.new}, {load}",
    }


def driver_action(
    facts: Mapping[str, Any],
    *,
    host: str,
    driver_min: str,
    cuda_version: str,
    branch: str,
    target: str = "",
    allow_reboot: bool = False,
    controller: bool = False,
    mok_enrolled: bool = False,
    inventory: list[str] | None = None,
    playbook: str = "provision.yml",
) -> dict[str, Any]:
    """Decide what the nvidia_driver role does on one node.

    facts: the node's llama_host facts (gpu_count, driver_loaded, driver_version, driver_installed,
    nouveau_loaded, secure_boot). driver_min: the minimum driver of the CUDA build ('' for none);
    branch: the pinned branch ('580'); target: the exact version the packages install, if pinned
    ('535.309.01-0+deb12u1'). allow_reboot: the operator's consent; controller: the node is the
    controller itself (never rebooted); mok_enrolled: DKMS signs modules with a key the firmware
    trusts. inventory and playbook go into the command printed to continue.

    Returns action (keep, install, upgrade, blocked), reboot (a reboot is needed to run the driver
    the node should run), blacklist_nouveau, loaded, installed, minimum, reason (one line) and
    stop (empty, or the one message this node stops with before anything changes).
    """
    node = _node(facts)
    if not str(branch).strip().isdigit():
        raise ValueError(f"the pinned branch is {branch!r}, not a driver branch such as 580")
    minimum = parse_version(driver_min, "driver_min") if str(driver_min).strip() else None
    target_version = parse_version(target, "the pinned version") if str(target).strip() else None
    case = _Case(
        host=host,
        playbook=playbook,
        pinned=int(branch),
        minimum=minimum,
        target=str(target),
        target_version=target_version,
        need=f"the minimum {_text(minimum)} of CUDA {cuda_version}" if minimum else "no minimum",
        new=_text(target_version) if target_version else f"branch {int(branch)}",
    )
    decision: dict[str, Any] = {
        "action": "keep",
        "reboot": False,
        "blacklist_nouveau": False,
        "loaded": _text(node["loaded"]) if node["loaded"] else None,
        "installed": _text(node["installed"]) if node["installed"] else None,
        "minimum": _text(minimum) if minimum else None,
        "reason": "no NVIDIA GPU: no driver to manage",
    }
    if node["gpu_count"] > 0:
        decision.update(_decide(case, node, mok_enrolled))
    policy = {"allow_reboot": allow_reboot, "controller": controller, "inventory": inventory or []}
    decision["stop"] = decision.get("stop") or _stop(case, decision, policy)
    return decision


# ---- the driver's packages and NVIDIA's CUDA repository ------------------------------------------
# NVIDIA's CUDA repository (Release label "NVIDIA CUDA", a mirror's too) carries the driver as
# well as the toolkit, newer than the distro's and under the distro's own names on Ubuntu
# (libnvidia-compute-580, nvidia-utils-580, ...). Added unpinned for the toolkit, the next
# `apt upgrade` swaps the driver's userspace from that repository under the module that runs, and
# every CUDA program on the node fails ("Driver/library version mismatch") until a reboot.
# The driver's packages on Ubuntu (nvidia-driver-580, libnvidia-compute-580, nvidia-utils-580,
# linux-modules-nvidia-580-*, cuda-drivers-580, ...) and on Debian (nvidia-driver,
# nvidia-kernel-dkms, nvidia-smi, libcuda1, libnvcuvid1, libnvoptix1, firmware-nvidia-gsp, ...):
# every name that holds "nvidia", and the few that do not.
DRIVER_PACKAGES = "/nvidia/ cuda-drivers* libcuda1* libnvcuvid* libnvoptix* libxnvctrl*"
CUDA_REPO_RELEASE = "l=NVIDIA CUDA"


def held_driver(decision: Mapping[str, Any] | None) -> str:
    """The driver version a node keeps, from driver_action's decision: the one on disk for the
    running kernel, else the loaded one; '' while the decision is to install or upgrade (the
    packages to come must not be held back by the version they replace) or with no driver."""
    if not decision or decision.get("action") in ("install", "upgrade"):
        return ""
    return str(decision.get("installed") or decision.get("loaded") or "")


def apt_preferences(driver_from_repo: bool, held: str = "") -> str:
    """/etc/apt/preferences.d's file that keeps NVIDIA's CUDA repository off the driver.

    driver_from_repo: the driver's packages come from that repository (nvidia_driver_source
    cuda_repo); held: the driver version the node keeps ('580.95.05', held_driver), '' before one
    is installed. The driver from elsewhere (the distro, the operator's): no version of a driver
    package is ever taken from the repository. The driver from the repository: the version the
    node has is held (priority 990, from any source, so neither the repository's newer build nor
    the distro's replaces it) and every other version of the repository's is refused; with no
    driver yet, nothing is said of the driver, so that its install can take it.
    """
    if held and not VERSION_RE.match(held):
        raise ValueError(f"the driver version to hold is {held!r}, not a version such as 580.95.05")
    lines = [
        "# Managed by llama-cluster (roles/cuda_toolkit, roles/nvidia_driver): NVIDIA's CUDA",
        "# repository gives the toolkit; it never replaces the driver's packages under a running",
        "# module (an `apt upgrade` would break every CUDA program until a reboot).",
    ]
    if driver_from_repo and not held:
        lines.append("# The driver is to come from the repository: held once installed.")
        return "\n".join(lines) + "\n"
    if driver_from_repo:
        lines += [
            f"# The driver came from the repository: {held} is held, no other version is taken.",
            f"Package: {DRIVER_PACKAGES}",
            f"Pin: version {held}*",
            "Pin-Priority: 990",
            "",
        ]
    else:
        lines.append("# The driver comes from elsewhere: none of its packages from the repository.")
    lines += [
        f"Package: {DRIVER_PACKAGES}",
        f"Pin: release {CUDA_REPO_RELEASE}",
        "Pin-Priority: -1",
    ]
    return "\n".join(lines) + "\n"
