"""The NVIDIA driver decision (module_utils/driver.py through the filter nvidia_driver_action):
one case per situation a node can be in, and bad facts failing with the node's name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.llama.cluster.plugins.filter.nvidia_driver import nvidia_driver_action

CU128 = {"driver_min": "525.60.13", "cuda_version": "12.8"}
CU130 = {"driver_min": "580.65.06", "cuda_version": "13.0"}
UBUNTU = {"branch": "580", "target": ""}
DEBIAN = {"branch": "535", "target": "535.309.01-0+deb12u1"}


def facts(loaded: str | None = None, **more: Any) -> dict[str, Any]:
    """One GPU as host_facts records it: no driver, nouveau or Secure Boot unless said."""
    return {
        "gpu_count": 1,
        "driver_loaded": loaded is not None,
        "driver_version": loaded,
        "driver_installed": loaded,
        "nouveau_loaded": False,
        "secure_boot": False,
        **more,
    }


def decide(node: dict[str, Any], build: dict = CU128, pin: dict = UBUNTU, **policy: Any) -> dict:
    return nvidia_driver_action(node, host="gpu2", **build, **pin, **policy)


def test_no_driver_installs_the_pinned_branch_and_loads_it_without_a_reboot():
    decision = decide(facts())
    assert decision["action"] == "install"
    assert decision["reboot"] is False
    assert decision["blacklist_nouveau"] is True
    assert decision["reason"] == (
        "no NVIDIA driver is loaded: install branch 580, then load it with modprobe"
    )
    assert decision["stop"] == ""


def test_a_driver_older_than_the_minimum_is_upgraded_only_with_consent_to_reboot():
    decision = decide(facts("470.256.02"))
    assert (decision["action"], decision["reboot"]) == ("upgrade", True)
    assert decision["loaded"] == "470.256.02"
    assert decision["minimum"] == "525.60.13"
    assert decision["reason"] == (
        "driver 470.256.02 is loaded, older than the minimum 525.60.13 of CUDA 12.8: install"
        " branch 580, then reboot to load it"
    )
    assert decision["stop"] == (
        "gpu2: driver 470.256.02 is loaded, older than the minimum 525.60.13 of CUDA 12.8:"
        " install branch 580, then reboot to load it. provision.yml reboots a node only when"
        " allowed, so nothing was changed on gpu2 (the new driver's libraries beside the loaded"
        " module would break the CUDA programs running on it). Continue with: ansible-playbook"
        " provision.yml -e allow_reboot=true --limit gpu2 or install branch 580 and reboot gpu2"
        " by hand, then run provision.yml again."
    )
    allowed = decide(facts("470.256.02"), allow_reboot=True)
    assert (allowed["action"], allowed["reboot"], allowed["stop"]) == ("upgrade", True, "")


def test_the_pinned_branch_is_kept():
    decision = decide(facts("580.95.05"))
    assert (decision["action"], decision["reboot"], decision["stop"]) == ("keep", False, "")
    assert decision["reason"] == (
        "driver 580.95.05 of the pinned branch 580 is loaded and meets the minimum 525.60.13 of"
        " CUDA 12.8: kept"
    )


def test_a_newer_branch_is_kept():
    decision = decide(facts("590.44.01"), CU130)
    assert (decision["action"], decision["reboot"]) == ("keep", False)
    assert decision["reason"] == (
        "driver 590.44.01 (branch 590, newer than the pinned 580) is loaded and meets the minimum"
        " 580.65.06 of CUDA 13.0: kept"
    )


def test_an_older_branch_that_meets_the_minimum_is_kept_not_replaced():
    decision = decide(facts("550.54.15"))
    assert (decision["action"], decision["reboot"], decision["blacklist_nouveau"]) == (
        "keep",
        False,
        False,
    )
    assert decision["reason"] == (
        "driver 550.54.15 (branch 550, older than the pinned 580) is loaded and meets the minimum"
        " 525.60.13 of CUDA 12.8: kept"
    )
    # The same driver under PyPI's CUDA 13.0 torch (>= 580) is too old.
    assert decide(facts("550.54.15"), CU130)["action"] == "upgrade"


def test_a_kept_driver_with_a_newer_one_installed_says_it_loads_at_the_next_reboot():
    decision = decide(facts("570.172.08", driver_installed="580.95.05"))
    assert (decision["action"], decision["reboot"]) == ("keep", False)
    assert decision["reason"].endswith(
        "(580.95.05 is installed and loads at the node's next reboot)"
    )


def test_nouveau_loaded_is_blacklisted_and_the_driver_installed_then_a_reboot():
    decision = decide(facts(nouveau_loaded=True))
    assert (decision["action"], decision["reboot"], decision["blacklist_nouveau"]) == (
        "install",
        True,
        True,
    )
    assert decision["reason"] == (
        "nouveau is loaded (it holds the GPUs): install branch 580, then reboot to load it"
    )
    assert "--limit gpu2 or blacklist nouveau and reboot gpu2 by hand" in decision["stop"]
    assert decide(facts(nouveau_loaded=True), allow_reboot="true")["stop"] == ""


def test_installed_but_not_loaded_needs_a_reboot_not_a_reinstall():
    decision = decide(facts(None, driver_installed="580.95.05"))
    assert (decision["action"], decision["reboot"]) == ("keep", True)
    assert decision["installed"] == "580.95.05"
    assert decision["reason"] == (
        "no NVIDIA driver is loaded; driver 580.95.05 is installed but not loaded: a reboot is"
        " pending, no reinstall"
    )
    assert decision["stop"] == (
        "gpu2: no NVIDIA driver is loaded; driver 580.95.05 is installed but not loaded: a"
        " reboot is pending, no reinstall. provision.yml reboots a node only when allowed."
        " Continue with: ansible-playbook provision.yml -e allow_reboot=true --limit gpu2 or"
        " reboot gpu2 by hand and run provision.yml again."
    )
    with_inventory = decide(
        facts(None, driver_installed="580.95.05"), inventory=["/srv/inv/hosts.yml"]
    )
    assert (
        "ansible-playbook -i /srv/inv/hosts.yml provision.yml -e allow_reboot=true"
        in (with_inventory["stop"])
    )
    assert with_inventory["stop"].endswith("or reboot gpu2 by hand and run provision.yml again.")


def test_an_old_loaded_driver_with_a_good_one_installed_waits_for_the_reboot():
    decision = decide(facts("470.256.02", driver_installed="580.95.05"))
    assert (decision["action"], decision["reboot"]) == ("keep", True)
    assert decision["reason"].startswith("driver 470.256.02 is loaded, older than the minimum")


def test_secure_boot_blocks_building_an_unsigned_module():
    decision = decide(facts(secure_boot=True))
    assert (decision["action"], decision["reboot"]) == ("blocked", False)
    assert decision["reason"] == (
        "no NVIDIA driver is loaded; Secure Boot is enabled and the branch 580 module DKMS would"
        " build is signed by no key the firmware trusts"
    )
    assert decision["stop"].startswith("gpu2: no NVIDIA driver is loaded, and Secure Boot")
    assert "Enroll a MOK key" in decision["stop"]
    assert "nvidia_driver_mok_enrolled: true" in decision["stop"]
    assert "disable Secure Boot" in decision["stop"]
    # An enrolled key lets DKMS sign the module; a driver already loaded is kept either way.
    assert decide(facts(secure_boot=True), mok_enrolled=True)["action"] == "install"
    assert decide(facts("580.95.05", secure_boot=True))["action"] == "keep"


def test_a_pinned_driver_older_than_the_minimum_is_blocked_before_install():
    decision = decide(facts(), CU130, DEBIAN)
    assert (decision["action"], decision["reboot"]) == ("blocked", False)
    assert decision["stop"] == (
        "gpu2: no NVIDIA driver is loaded, and the driver it would get, 535.309.01-0+deb12u1, is"
        " older than the minimum 580.65.06 of CUDA 13.0. Pick a cuda_version whose minimum this"
        " driver meets (a 12.x build for branch 535), or a newer branch with"
        " nvidia_driver_source: cuda_repo."
    )
    # A 580 the operator installed on Debian meets CUDA 13.0: kept, nothing to install.
    assert decide(facts("580.95.05"), CU130, DEBIAN)["action"] == "keep"
    assert decide(facts(), CU128, DEBIAN)["reason"] == (
        "no NVIDIA driver is loaded: install 535.309.01, then load it with modprobe"
    )


def test_the_controller_is_never_rebooted_even_when_allowed():
    decision = decide(facts(nouveau_loaded=True), allow_reboot=True, controller=True)
    assert decision["reboot"] is True
    assert decision["stop"].endswith(
        "gpu2 is the controller itself, which provision.yml never reboots: reboot it by hand,"
        " then run provision.yml again."
    )


def test_a_node_without_gpus_needs_no_driver():
    decision = decide({"gpu_count": 0, "driver_loaded": False, "driver_version": None})
    assert (decision["action"], decision["reboot"], decision["stop"]) == ("keep", False, "")


def test_facts_of_an_older_probe_without_the_new_fields_still_decide():
    old = {"gpu_count": 2, "driver_loaded": True, "driver_version": "580.159.04"}
    assert decide(old)["action"] == "keep"


@pytest.mark.parametrize(
    ("node", "problem"),
    [
        ([], "the node's facts are list, not a mapping"),
        ({"driver_loaded": False}, "the fact gpu_count is None, not a number of GPUs"),
        (facts(gpu_count="two"), "the fact gpu_count is 'two', not a number of GPUs"),
        (facts("580.x"), "the fact driver_version is '580.x', not a driver version"),
        (facts(None, driver_loaded=True), "driver_loaded is true but driver_version is empty"),
        (facts(secure_boot="yes"), "the fact secure_boot is 'yes', not true, false or null"),
    ],
)
def test_bad_facts_fail_naming_the_node_the_fact_and_the_fix(node: Any, problem: str):
    with pytest.raises(AnsibleFilterError) as err:
        decide(node)
    assert str(err.value).startswith("gpu2: cannot decide on the NVIDIA driver: ")
    assert problem in str(err.value)
    assert "provision.yml --tags host_facts" in str(err.value)


def test_a_bad_pin_fails_naming_it():
    with pytest.raises(AnsibleFilterError, match="the pinned branch is 'r580'"):
        decide(facts(), pin={"branch": "r580"})
    with pytest.raises(AnsibleFilterError, match="driver_min is 'new'"):
        decide(facts(), build={"driver_min": "new", "cuda_version": "12.8"})


# The facts the decision reads, as roles/host_facts/files/gpu_probe.py records them.

PROBE = Path(__file__).resolve().parents[3] / "roles/host_facts/files/gpu_probe.py"


def probe(tmp_path: Path, sysfs: Path, modinfo_version: str | None) -> dict[str, Any]:
    """Run the probe on an empty PCI bus with a fake sysfs and a fake modinfo on PATH."""
    pci = tmp_path / "pci"
    pci.mkdir(exist_ok=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    modinfo = bin_dir / "modinfo"
    if modinfo_version is None:
        modinfo.write_text(
            "#!/bin/sh\necho 'modinfo: ERROR: Module nvidia not found.' >&2\nexit 1\n"
        )
    else:
        modinfo.write_text(f'#!/bin/sh\n[ "$3" = nvidia ] && echo {modinfo_version}\n')
    modinfo.chmod(0o755)
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(pci), str(sysfs)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PATH": str(bin_dir)},
    )
    return json.loads(proc.stdout)


def test_gpu_probe_records_a_pending_module_nouveau_and_secure_boot(tmp_path: Path):
    sysfs = tmp_path / "sys"
    (sysfs / "module/nouveau").mkdir(parents=True)
    efivars = sysfs / "firmware/efi/efivars"
    efivars.mkdir(parents=True)
    var = efivars / "SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
    var.write_bytes(b"\x06\x00\x00\x00\x01")
    found = probe(tmp_path, sysfs, "580.95.05")
    assert found["driver_installed"] == "580.95.05"
    assert found["driver_loaded"] is False
    assert found["nouveau_loaded"] is True
    assert found["secure_boot"] is True

    var.write_bytes(b"\x06\x00\x00\x00\x00")
    (sysfs / "module/nouveau").rmdir()
    found = probe(tmp_path, sysfs, None)
    assert (found["driver_installed"], found["nouveau_loaded"], found["secure_boot"]) == (
        None,
        False,
        False,
    )


def test_gpu_probe_reports_no_secure_boot_on_a_bios_boot(tmp_path: Path):
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    assert probe(tmp_path, sysfs, None)["secure_boot"] is False


def fake_smi(bin_dir: Path, caps: str | None) -> None:
    """An nvidia-smi with two GPUs; `caps` answers the compute_cap query (None: too old for it)."""
    too_old = "echo 'Field \"compute_cap\" is not a valid field' >&2; exit 2"
    cap_answer = f"printf '{caps}'" if caps is not None else too_old
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --query-gpu=index,compute_cap) " + cap_answer + " ;;\n"
        "  --query-gpu=*) printf '0, NVIDIA GeForce RTX 4090, 24564, 570.86.15, 00000000:01:00.0\\n"
        "1, NVIDIA GeForce RTX 4090, 24564, 570.86.15, 00000000:02:00.0\\n' ;;\n"
        "  *) echo 'CUDA Version: 12.8' ;;\n"
        "esac\n"
    )
    smi.chmod(0o755)


@pytest.mark.parametrize(("caps", "expected"), [("0, 8.9\n1, 8.9\n", "8.9"), (None, None)])
def test_gpu_probe_records_the_compute_capability_where_nvidia_smi_knows_it(
    tmp_path: Path, caps: str | None, expected: str | None
) -> None:
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    (tmp_path / "bin").mkdir()
    fake_smi(tmp_path / "bin", caps)
    found = probe(tmp_path, sysfs, None)
    assert [g["name"] for g in found["gpus"]] == ["NVIDIA GeForce RTX 4090"] * 2
    assert [g.get("compute_capability") for g in found["gpus"]] == [expected, expected]
    assert found["driver_version"] == "570.86.15"
