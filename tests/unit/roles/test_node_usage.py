"""Plans for the memory that is free (issue 38): what a node's GPUs and memory hold at train time
(plugins/modules/llama_node_usage.py) and what the planner does with it
(plugins/module_utils/planner/nodes.py: describe_nodes with each node's usage).

nvidia-smi cannot run on this machine (no GPU), so its answers are replayed from
tests/data/nvidia-smi/, in the exact format of `nvidia-smi --query-gpu=... --format=csv,noheader,
nounits` and `--query-compute-apps=...` (written in that format, not captured on those machines):

- idle-8x-h100: an idle 8-GPU node (1 MiB used on each, no process);
- other-user-gpu1: the same node while another user's python3 holds 52.5 GiB of GPU 1;
- other-container: 4 L40S, 29.5 GiB of GPU 0 in use and no process listed (a process of another
  container), 512 MiB of GPU 2 (below the threshold: a display, an idle context);
- mig: two A100s in MIG mode, memory.used [N/A], one process [Not Found] on GPU 0 and one on a
  MIG device's UUID;
- no-driver.out, no-devices.out: what nvidia-smi prints when it fails (exit status 9 and 6).

/proc is this machine's own where a test needs a real process (its user and command line read
back), and a directory of recorded entries where the process is another user's.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.modules import llama_node_usage as usage

from tests.support.node_usage import H100, MODULE, NOBODY, SMI, _recorded, read


def test_an_idle_8_gpu_node_is_read_gpu_by_gpu() -> None:
    gpus = usage.parse_gpus(_recorded("idle-8x-h100", "gpus"))
    assert [g["index"] for g in gpus] == list(range(8))
    assert gpus[1] == {
        "index": 1,
        "uuid": "GPU-6e1c2c4f-0a7d-4d1e-9b43-7c1f2f0a9b11",
        "name": H100,
        "memory_total_mib": 81559,
        "memory_used_mib": 1,
        "processes": [],
    }
    assert usage.parse_apps(_recorded("idle-8x-h100", "apps")) == []


def test_a_process_of_another_user_is_put_on_its_gpu_with_user_and_command(proc: Path) -> None:
    apps = usage.parse_apps(_recorded("other-user-gpu1", "apps"))
    assert apps == [
        {
            "pid": 48213,
            "gpu_uuid": "GPU-6e1c2c4f-0a7d-4d1e-9b43-7c1f2f0a9b11",
            "used_memory_mib": 53792,
            "process_name": "python3",
        }
    ]
    found = read("other-user-gpu1", proc)
    assert found["unattributed_processes"] == []
    assert [len(g["processes"]) for g in found["gpus"]] == [0, 1, 0, 0, 0, 0, 0, 0]
    assert found["gpus"][1]["processes"] == [
        {
            "pid": 48213,
            "used_memory_mib": 53792,
            "process_name": "python3",
            "visible": True,
            "uid": NOBODY,
            "user": pwd.getpwuid(NOBODY).pw_name,
            "command": "python3 finetune.py --config big.yaml",
        }
    ]


def test_mig_and_placeholder_fields_read_as_unknown_not_as_numbers(proc: Path) -> None:
    gpus = usage.parse_gpus(_recorded("mig", "gpus"))
    assert [(g["memory_total_mib"], g["memory_used_mib"]) for g in gpus] == [(81920, None)] * 2
    apps = usage.parse_apps(_recorded("mig", "apps"))
    assert [(a["used_memory_mib"], a["process_name"]) for a in apps] == [
        (None, ""),
        (None, "/opt/conda/bin/python"),
    ]
    # The process on a MIG device's UUID names no GPU of the list; neither pid is on this node.
    found = read("mig", proc)
    (elsewhere,) = found["unattributed_processes"]
    assert elsewhere["gpu_uuid"].startswith("MIG-")
    assert elsewhere["visible"] is False
    assert found["gpus"][0]["processes"][0]["visible"] is False


def test_what_is_not_a_row_is_left_out_and_a_name_keeps_its_commas() -> None:
    for said in ("no-driver", "no-devices"):
        text = (SMI / f"{said}.out").read_text()
        assert usage.parse_gpus(text) == []
        assert usage.parse_apps(text) == []
    (app,) = usage.parse_apps("7, GPU-x, 100, /srv/a,b/python\n")
    assert app["process_name"] == "/srv/a,b/python"
    assert usage.number("[Not Supported]") is None
    assert usage.number("1024.4") == 1024


# ---- /proc: the process behind a pid, when this node sees it -------------------------------------
@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    """A real process of this machine: this test's Python, asleep, with a marker argument."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--gib", "52"])
    cmdline = Path(f"/proc/{child.pid}/cmdline")
    deadline = time.monotonic() + 10
    while b"--gib" not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)  # Popen may return before the child's exec (it is pytest until then)
    yield child
    child.kill()
    child.wait()


def test_a_process_of_this_node_is_named_with_its_user_and_command_line(sleeper) -> None:
    app = {"pid": sleeper.pid, "used_memory_mib": 53792, "process_name": sys.executable}
    found = usage.describe_process(app)
    assert found["visible"] is True
    assert (found["uid"], found["user"]) == (os.getuid(), pwd.getpwuid(os.getuid()).pw_name)
    assert found["command"] == f"{sys.executable} -c import time; time.sleep(60) --gib 52"


def test_a_pid_of_another_namespace_is_not_taken_for_this_nodes_process(
    sleeper, tmp_path: Path
) -> None:
    # nvidia-smi names a python; this node's process of that pid is another program.
    app = {"pid": sleeper.pid, "used_memory_mib": 100, "process_name": "/usr/bin/ruby"}
    found = usage.describe_process(app)
    assert found["visible"] is False
    assert "not nvidia-smi's /usr/bin/ruby" in found["why"]
    assert "another container or PID namespace" in found["why"]
    # No such pid in this node's /proc at all.
    gone = usage.describe_process({**app, "process_name": "python3"}, tmp_path)
    assert gone["visible"] is False
    assert gone["why"].startswith(f"no process {sleeper.pid} in this node's /proc")


# ---- host memory: MemAvailable and the cgroup ----------------------------------------------------
def _memory(
    tmp: Path, available_kib: int, cgroup: dict[str, str], membership: str = ""
) -> dict[str, Any]:
    (tmp / "meminfo").write_text(
        f"MemTotal:       131072000 kB\nMemFree:         1000000 kB\n"
        f"MemAvailable:   {available_kib} kB\n"
    )
    root = tmp / "cgroup"
    for name, text in cgroup.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp / "self_cgroup").write_text(membership)
    return usage.host_memory(tmp / "meminfo", root, tmp / "self_cgroup")


def test_the_limit_of_the_modules_own_cgroup_counts_where_it_shares_the_hosts_tree(
    tmp_path: Path,
) -> None:
    """A container with systemd shares the host's cgroup tree (cgroupns host): its limit is at
    its own path, which /proc/self/cgroup names, not at the root."""
    gib = 1024**3
    v1 = {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/docker/abc/memory.limit_in_bytes": f"{2 * gib}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{gib}\n",
        "memory/docker/abc/memory.stat": f"total_inactive_file {gib // 2}\n",
    }
    found = _memory(tmp_path, 100 * 1024 * 1024, v1, "12:memory:/docker/abc/init.scope\n")
    assert (found["available_mib"], found["cgroup_limit_mib"]) == (1536, 2048)
    assert found["source"] == "the cgroup's limit less its usage"


def test_the_tightest_limit_of_a_cgroup_and_its_parents_counts(tmp_path: Path) -> None:
    gib = 1024**3
    v2 = {
        "user.slice/memory.max": f"{8 * gib}\n",
        "user.slice/memory.current": f"{7 * gib}\n",
        "user.slice/user-1000.slice/memory.max": f"{4 * gib}\n",
        "user.slice/user-1000.slice/memory.current": f"{gib}\n",
    }
    found = _memory(tmp_path, 100 * 1024 * 1024, v2, "0::/user.slice/user-1000.slice\n")
    assert (found["available_mib"], found["cgroup_limit_mib"]) == (1024, 8192)


def test_host_memory_is_memavailable_where_no_cgroup_limit_applies(tmp_path: Path) -> None:
    v2 = {"memory.max": "max\n", "memory.current": "4096\n"}
    found = _memory(tmp_path, 100 * 1024 * 1024, v2)
    assert (found["available_mib"], found["source"]) == (102400, "MemAvailable (/proc/meminfo)")
    assert found["cgroup_limit_mib"] is None
    # cgroup v1's "no limit" is a page counter's maximum.
    v1 = {"memory/memory.limit_in_bytes": "9223372036854771712\n"}
    assert _memory(tmp_path, 1024, v1)["source"] == "MemAvailable (/proc/meminfo)"


@pytest.mark.parametrize(
    "cgroup",
    [
        {
            "memory.max": f"{64 << 30}\n",
            "memory.current": f"{40 << 30}\n",
            "memory.stat": f"anon {30 << 30}\nfile {10 << 30}\ninactive_file {8 << 30}\n",
        },
        {
            "memory/memory.limit_in_bytes": f"{64 << 30}\n",
            "memory/memory.usage_in_bytes": f"{40 << 30}\n",
            "memory/memory.stat": f"cache {10 << 30}\ntotal_inactive_file {8 << 30}\n",
        },
    ],
    ids=["v2", "v1"],
)
def test_a_container_has_its_limit_less_its_usage_less_reclaimable_cache(
    tmp_path: Path, cgroup: dict[str, str]
) -> None:
    found = _memory(tmp_path, 100 * 1024 * 1024, cgroup)
    # 64 GiB - (40 GiB used - 8 GiB of inactive page cache) = 32 GiB, below MemAvailable's 100.
    assert found["available_mib"] == 32 * 1024
    assert found["source"] == "the cgroup's limit less its usage"
    assert (found["cgroup_limit_mib"], found["meminfo_available_mib"]) == (65536, 102400)


def test_this_machines_host_memory_is_read() -> None:
    found = usage.host_memory()
    assert found["available_mib"] > 0
    assert found["available_mib"] <= found["meminfo_available_mib"]


# ---- the module, with nvidia-smi's answers replayed ----------------------------------------------
def _nvidia_smi(tmp: Path, gpus: str, apps: str = "", status: int = 0) -> Path:
    """An nvidia-smi that answers the two queries with recorded text, and exits with status."""
    (tmp / "gpus.csv").write_text(gpus)
    (tmp / "apps.csv").write_text(apps)
    program = tmp / "nvidia-smi"
    program.write_text(
        f"#!{sys.executable}\nimport sys\n"
        f"which = 'gpus' if sys.argv[1].startswith('--query-gpu=') else 'apps'\n"
        f"sys.stdout.write(open('{tmp}/' + which + '.csv').read())\nsys.exit({status})\n"
    )
    program.chmod(0o755)
    return program


def _module(args: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(MODULE)],
        input=json.dumps({"ANSIBLE_MODULE_ARGS": args}),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_the_module_names_this_nodes_process_on_the_gpu_in_check_mode_too(
    tmp_path: Path, sleeper
) -> None:
    apps = f"{sleeper.pid}, GPU-6e1c2c4f-0a7d-4d1e-9b43-7c1f2f0a9b11, 53792, {sys.executable}\n"
    smi = _nvidia_smi(tmp_path, _recorded("other-user-gpu1", "gpus"), apps)
    for check_mode in (False, True):
        found = _module({"nvidia_smi": str(smi), "_ansible_check_mode": check_mode})
        assert found["changed"] is False
        assert (found["nvidia_smi_found"], found["nvidia_smi_error"]) == (True, "")
        (held,) = found["gpus"][1]["processes"]
        assert (held["pid"], held["visible"], held["used_memory_mib"]) == (sleeper.pid, True, 53792)
        assert held["command"].endswith("--gib 52")
        assert found["host_memory"]["available_mib"] > 0


def test_a_cpu_node_has_no_gpus_and_is_not_failed() -> None:
    found = _module({"nvidia_smi": "/nonexistent/nvidia-smi"})
    assert (found["gpus"], found["nvidia_smi_found"], found["nvidia_smi_error"]) == ([], False, "")
    assert found["host_memory"]["available_mib"] > 0


def test_an_nvidia_smi_that_fails_is_reported_not_failed(tmp_path: Path) -> None:
    smi = _nvidia_smi(tmp_path, (SMI / "no-driver.out").read_text(), status=9)
    found = _module({"nvidia_smi": str(smi)})
    assert found["gpus"] == []
    assert found["nvidia_smi_error"].startswith(
        "--query-gpu=index,uuid,name,memory.total,memory.used: exit status 9: NVIDIA-SMI has "
        "failed because it couldn't communicate with the NVIDIA driver."
    )
