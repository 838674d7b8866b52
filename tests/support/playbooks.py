"""Playbooks run as a user runs them, on inventories of TEST-NET addresses (192.0.2.0/24) that
nothing answers: a request that got past the controller's checks would fail on "unreachable"
instead of the message a test asserts. GPU nodes carry their facts in the inventory
(`ansible_local`, the shape roles/host_facts records), as cached facts are found."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")


def _node(address: str, gpu_mib: list[int] | None = None, **extra: object) -> str:
    settings: dict[str, object] = {
        "ansible_host": address,
        "cluster_accelerator": "cpu",
        "nproc_per_node": 1,
    }
    if gpu_mib is not None:
        gpus = [{"index": i, "memory_mib": mib} for i, mib in enumerate(gpu_mib)]
        settings["cluster_accelerator"] = "nvidia"
        settings["ansible_local"] = {"llama_host": {"gpus": gpus, "gpu_count": len(gpus)}}
    settings.update(extra)
    return json.dumps(settings)


def _inventory(tmp: Path, master: dict[str, str], workers: dict[str, str]) -> Path:
    path = tmp / "inventory.yml"
    lines = ["all:", "  children:", "    cluster:", "      children:"]
    lines += ["        master:", "          hosts:"] + [
        f"            {h}: {v}" for h, v in master.items()
    ]
    if workers:
        lines += ["        workers:", "          hosts:"] + [
            f"            {h}: {v}" for h, v in workers.items()
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(inventory: Path, *extra: str, playbook: str = "train.yml") -> tuple[int, str]:
    done = subprocess.run(
        # The runs train.yml plans are claimed (made) under the test's own directory.
        [
            *(str(ANSIBLE_PLAYBOOK), "-i", str(inventory), playbook),
            *("-e", f"controller_runs_dir={inventory.parent / 'runs'}", *extra),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={
            "ANSIBLE_NOCOLOR": "1",
            "PATH": "/usr/bin:/bin",
            "HOME": str(inventory.parent),
            # A fact cache of the test's own: no facts from other runs, none left behind.
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(inventory.parent / "facts"),
        },
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def _fails_before_nodes(inventory: Path, *extra: str) -> str:
    rc, out = _train(inventory, *extra)
    assert rc != 0, out[-2000:]
    assert "Train | Prepare every node" not in out, "a node was contacted"
    assert "UNREACHABLE" not in out
    return out
