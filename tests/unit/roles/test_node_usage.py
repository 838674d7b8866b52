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
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.assembly import (
    RUN_STAMP,
    new_run_id,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.nodes import (
    BUSY_GPU_MIB,
    describe_nodes,
    node_gpu_usage,
    node_host_memory,
    usage_by_host,
)
from ansible_collections.llama.cluster.plugins.modules import llama_node_usage as usage

from tests.unit.planner.test_train_validation import _inventory, _node, _train

ROOT = Path(__file__).resolve().parents[3]
SMI = ROOT / "tests" / "data" / "nvidia-smi"
MODULE = ROOT / "collections/ansible_collections/llama/cluster/plugins/modules/llama_node_usage.py"
H100 = "NVIDIA H100 80GB HBM3"
NOBODY = 65534  # another user, on every Debian and Ubuntu machine
HOG = {"pid": 48213, "argv": ["python3", "finetune.py", "--config", "big.yaml"]}


def _recorded(case: str, kind: str) -> str:
    return (SMI / f"{case}.{kind}.csv").read_text()


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A /proc with one recorded entry: another user's (nobody's) python3, pid 48213."""
    entry = tmp_path / "proc" / str(HOG["pid"])
    entry.mkdir(parents=True)
    entry.joinpath("status").write_text(
        f"Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nPid:\t{HOG['pid']}\n"
        f"Uid:\t{NOBODY}\t{NOBODY}\t{NOBODY}\t{NOBODY}\nGid:\t{NOBODY}\t{NOBODY}\t{NOBODY}\n"
    )
    entry.joinpath("cmdline").write_text("\0".join(HOG["argv"]) + "\0")
    entry.joinpath("comm").write_text("python3\n")
    return tmp_path / "proc"


def read(case: str, proc: Path) -> dict[str, Any]:
    """What llama_node_usage returns on a node whose nvidia-smi answers as recorded in `case`,
    with 96 GiB of host memory available."""
    gpus = usage.parse_gpus(_recorded(case, "gpus"))
    elsewhere = usage.attach_processes(gpus, usage.parse_apps(_recorded(case, "apps")), proc)
    return {
        "changed": False,
        "gpus": gpus,
        "unattributed_processes": elsewhere,
        "nvidia_smi_found": True,
        "nvidia_smi_error": "",
        "host_memory": {"available_mib": 96 * 1024, "source": "MemAvailable (/proc/meminfo)"},
    }


# ---- nvidia-smi's answers, parsed ----------------------------------------------------------------
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


# ---- the planner: what is free now, and who holds the rest ---------------------------------------
def _hostvars(
    mib: list[int],
    nproc: int | None = None,
    host_mib: int = 2_000_000,
    **extra: Any,
) -> dict[str, Any]:
    """A GPU node's hostvars, its facts as roles/host_facts records them."""
    gpus = [{"index": i, "memory_mib": m, "name": H100} for i, m in enumerate(mib)]
    facts = {"gpus": gpus, "gpu_count": len(gpus), "host_memory_mib": host_mib}
    node = {"cluster_accelerator": "nvidia", "ansible_local": {"llama_host": facts}}
    node["nproc_per_node"] = len(mib) if nproc is None else nproc
    return {**node, **extra}


def _describe(nodes: dict[str, dict[str, Any]], found: dict[str, Any]) -> list[dict[str, Any]]:
    ranks = {host: rank for rank, host in enumerate(nodes)}
    nprocs = {host: node["nproc_per_node"] for host, node in nodes.items()}
    return describe_nodes(ranks, nodes, nprocs, found)


def test_an_idle_node_is_planned_for_what_is_free_now(proc: Path) -> None:
    (node,) = _describe({"g1": _hostvars([81559] * 8)}, {"g1": read("idle-8x-h100", proc)})
    # 81,559 - 1 MiB used = 81,558 MiB = 79.65 GiB, rounded down.
    assert node["gpu_memory_gib"] == 79.6
    assert node["memory_source"] == "free now (nvidia-smi at train time), smallest of 8 GPUs"


def test_a_gpu_another_user_holds_stops_the_plan_naming_process_memory_and_ways_out(
    proc: Path,
) -> None:
    with pytest.raises(PlanError) as refused:
        _describe({"g1": _hostvars([81559] * 8)}, {"g1": read("other-user-gpu1", proc)})
    said = str(refused.value)
    user = pwd.getpwuid(NOBODY).pw_name
    assert said.startswith("Other work holds GPUs this run needs")
    assert "g1: another process holds a GPU this run needs (it trains on GPUs 0, 1, 2, 3, 4, 5" in (
        said
    )
    assert (
        f"GPU 1 ({H100}) is held by pid 48213 (user {user}: python3 finetune.py --config "
        "big.yaml), 52.5 GiB; 27.1 of 79.6 GiB free now"
    ) in said
    assert "Stop it, leave it out with gpu_ids (e.g. gpu_ids=[0, 2, 3, 4, 5, 6, 7] for g1" in said
    assert "-e gpu_memory_gib=N (N <= 27.1, the least free on a GPU this run needs" in said


@pytest.mark.parametrize(
    ("settings", "gpus"),
    [({"gpu_ids": [0, 2, 3]}, 3), ({"nproc": 1}, 1)],
    ids=["gpu_ids leave it out", "one process trains on GPU 0"],
)
def test_a_held_gpu_the_run_does_not_use_is_no_obstacle(
    proc: Path, settings: dict[str, Any], gpus: int
) -> None:
    nproc = settings.pop("nproc", None)
    hostvars = _hostvars([81559] * 8, nproc=nproc, **settings)
    (node,) = _describe({"g1": hostvars}, {"g1": read("other-user-gpu1", proc)})
    assert node["gpu_memory_gib"] == 79.6
    which = "GPU" if gpus == 1 else f"smallest of {gpus} GPUs"
    assert node["memory_source"] == f"free now (nvidia-smi at train time), {which}"


def test_gpu_memory_gib_accepts_a_share_no_larger_than_what_is_free(proc: Path) -> None:
    found = {"g1": read("other-user-gpu1", proc)}
    (node,) = _describe({"g1": _hostvars([81559] * 8, gpu_memory_gib=20)}, found)
    assert node["gpu_memory_gib"] == 20.0
    assert node["memory_source"] == (
        f"gpu_memory_gib (inventory or -e): a share of GPU 1 ({H100}), which other processes "
        "hold (27.1 GiB free now, nvidia-smi at train time)"
    )
    with pytest.raises(PlanError, match=r"g1: gpu_memory_gib = 40 GiB is more than is free now"):
        _describe({"g1": _hostvars([81559] * 8, gpu_memory_gib="40")}, found)
    with pytest.raises(PlanError, match=r"Set gpu_memory_gib to at most 27.1, stop those"):
        _describe({"g1": _hostvars([81559] * 8, gpu_memory_gib="40")}, found)


def test_gpu_memory_gib_still_wins_on_an_idle_node(proc: Path) -> None:
    hostvars = _hostvars([81559] * 8, gpu_memory_gib=40)
    (node,) = _describe({"g1": hostvars}, {"g1": read("idle-8x-h100", proc)})
    assert (node["gpu_memory_gib"], node["memory_source"]) == (
        40.0,
        "gpu_memory_gib (inventory or -e), over the facts",
    )


def test_memory_in_use_with_no_process_listed_is_held_by_another_container(proc: Path) -> None:
    assert 512 < BUSY_GPU_MIB < 30211
    with pytest.raises(PlanError) as refused:
        _describe({"g2": _hostvars([46068] * 4)}, {"g2": read("other-container", proc)})
    said = str(refused.value)
    # GPU 0 is held; GPU 2's 512 MiB are not counted as another's work.
    assert (
        "GPU 0 (NVIDIA L40S) is 29.5 GiB in use, held by processes this node cannot see "
        "(another container?); 15.4 of 45.0 GiB free now"
    ) in said
    assert "GPU 2" not in said
    assert "e.g. gpu_ids=[1, 2, 3] for g2" in said


def test_several_nodes_are_refused_in_one_message(proc: Path) -> None:
    nodes = {"g1": _hostvars([81559] * 8), "g2": _hostvars([46068] * 4)}
    found = {"g1": read("other-user-gpu1", proc), "g2": read("other-container", proc)}
    with pytest.raises(PlanError) as refused:
        _describe(nodes, found)
    assert re.search(r"g1: another process .* g2: another process", str(refused.value))


def test_a_run_of_this_cluster_on_the_gpu_is_named_with_status_and_stop(proc: Path) -> None:
    found = read("other-user-gpu1", proc)
    found["gpus"][1]["processes"][0]["command"] = (
        "/opt/llama-cluster/env/bin/python -m llamafactory.launcher "
        "/opt/llama-cluster/runs/train-20261204-120000-qwen-7b/train.yaml"
    )
    hostvars = _hostvars([81559] * 8, cluster_runs_dir="/opt/llama-cluster/runs")
    with pytest.raises(PlanError, match=r"a run of this cluster: playbooks/status.yml shows it"):
        _describe({"g1": hostvars}, {"g1": found})


def test_mig_gpus_without_a_used_figure_need_gpu_memory_gib(proc: Path) -> None:
    found = {"m": read("mig", proc)}
    # GPU 0 has a process (of another namespace, its memory not reported): refused.
    with pytest.raises(PlanError) as refused:
        _describe({"m": _hostvars([81920] * 2)}, found)
    said = str(refused.value)
    assert "pid 30417 (no name reported, memory not reported), which this node cannot see" in said
    assert "accept a share with -e gpu_memory_gib=N (nvidia-smi reports no free figure)" in said
    # GPU 1 alone: no process listed, no used figure: the facts, and the knob to set.
    (node,) = _describe({"m": _hostvars([81920] * 2, gpu_ids=[1])}, found)
    assert node["gpu_memory_gib"] == 80.0
    assert node["memory_source"] == (
        "facts, GPU (at train time nvidia-smi reports no used memory for GPU 1 "
        "(NVIDIA A100-SXM4-80GB): a MIG GPU? set gpu_memory_gib to its slice)"
    )
    (node,) = _describe({"m": _hostvars([81920] * 2, gpu_memory_gib=10)}, found)
    assert node["gpu_memory_gib"] == 10.0
    assert "free memory not reported" in node["memory_source"]


def test_a_node_whose_read_failed_or_did_not_answer_is_planned_from_its_facts() -> None:
    hostvars = _hostvars([81559])
    facts = (79.6, "facts, GPU")
    reads = {
        "no answer": {"unreachable": True, "msg": "Failed to connect to the host via ssh"},
        "failed": {"failed": False, "msg": "sudo: a password is required", "item": "g1"},
        "nvidia-smi failed": {
            "gpus": [],
            "nvidia_smi_error": "--query-gpu=...: exit status 9: NVIDIA-SMI has failed",
        },
        "not asked for": {"skipped": True, "item": "g1"},
    }
    said = {case: node_gpu_usage("g1", hostvars, found, 1, facts) for case, found in reads.items()}
    assert said == {
        "no answer": (
            79.6,
            "facts, GPU; the node did not answer the read of its usage at train time",
            "",
        ),
        "failed": (
            79.6,
            "facts, GPU; the read of its usage at train time failed: sudo: a password is required",
            "",
        ),
        "nvidia-smi failed": (
            79.6,
            "facts, GPU (at train time nvidia-smi failed: --query-gpu=...: exit status 9: "
            "NVIDIA-SMI has failed)",
            "",
        ),
        "not asked for": (79.6, "facts, GPU", ""),
    }


def test_gpu_ids_that_nvidia_smi_no_longer_lists_are_refused(proc: Path) -> None:
    with pytest.raises(PlanError, match=r"g1: gpu_ids \[0, 9\] name GPUs \[9\] that nvidia-smi"):
        node_gpu_usage(
            "g1", _hostvars([81559] * 10, gpu_ids=[0, 9]), read("idle-8x-h100", proc), 2, (1.0, "")
        )


def test_host_memory_is_the_smaller_of_the_facts_and_what_is_available_now() -> None:
    hostvars = _hostvars([81559], host_mib=128_000)
    now = {"gpus": [], "host_memory": {"available_mib": 60_000, "source": "MemAvailable"}}
    assert node_host_memory("g1", hostvars, now) == (
        58.5,
        "available now (MemAvailable at train time), of 125 GiB in the facts",
    )
    more = {"gpus": [], "host_memory": {"available_mib": 200_000, "source": "MemAvailable"}}
    assert node_host_memory("g1", hostvars, more) == (125.0, "facts (no less is available now)")
    # host_memory_gib still wins; without a read, the facts as before.
    assert node_host_memory("g1", {**hostvars, "host_memory_gib": 64}, now)[0] == 64.0
    assert node_host_memory("g1", hostvars) == (125.0, "facts")
    assert node_host_memory("g1", hostvars, {"unreachable": True}) == (
        125.0,
        "facts; the node did not answer the read of its usage at train time",
    )


def test_a_cpu_node_is_planned_for_the_host_memory_available_now() -> None:
    cpu = {"cluster_accelerator": "cpu", "nproc_per_node": 1}
    now = {"gpus": [], "host_memory": {"available_mib": 23_157, "source": "MemAvailable"}}
    (node,) = _describe({"c1": cpu}, {"c1": now})
    assert (node["gpu_memory_gib"], node["memory_source"]) == (None, "CPU node")
    assert (node["host_memory_gib"], node["host_memory_source"]) == (
        22.6,
        "available now (MemAvailable at train time)",
    )


def test_the_registered_loop_is_read_by_node() -> None:
    results = [{"item": "a", "gpus": []}, {"item": "b", "unreachable": True}, {"no": "item"}]
    assert usage_by_host(results) == {"a": results[0], "b": results[1]}
    assert usage_by_host(None) == {}


# ---- the action: plan from the facts, then again for what the nodes hold now ---------------------
def _plan_twice(tmp: Path, found: list[dict[str, Any]], *extra: str) -> tuple[int, str]:
    """llama.cluster.run_plan as train.yml calls it: from the facts (the request checked, the
    run's id claimed), then again with the nodes' reads; both results kept in results.json. One GPU
    node, g1, whose facts are in the inventory (tests/unit/planner/test_train_validation.py's
    nodes)."""
    inventory = _inventory(tmp, {"g1": _node("192.0.2.1", [81559])}, {})
    asked = {"model": "qwen2.5-1.5b", "probe_model": False, "claim_run_id": True}
    first = {"llama.cluster.run_plan": asked, "register": "first", "name": "Plan"}
    again = {"replan": "{{ first }}", "node_usage": found}
    second = {"llama.cluster.run_plan": again, "register": "now", "name": "Plan again"}
    keep = {"content": "{{ [first, now] | to_json }}", "dest": str(tmp / "results.json")}
    kept = {"ansible.builtin.copy": keep, "name": "Keep both results"}
    play = {"hosts": "localhost", "gather_facts": False, "tasks": [first, second, kept]}
    (tmp / "plan.yml").write_text(json.dumps([play]))
    return _train(inventory, *extra, playbook=str(tmp / "plan.yml"))


def _one_gpu(found: dict[str, Any]) -> dict[str, Any]:
    """The recorded read of the 8-GPU node cut to its GPU 1 (the other user's python on it),
    as node g1's only GPU, GPU 0; as the task looped over the nodes registers it."""
    return {**found, "gpus": [{**found["gpus"][1], "index": 0}], "item": "g1"}


def test_the_action_plans_again_for_what_is_free_keeping_the_run(
    tmp_path: Path, proc: Path
) -> None:
    # Other runs hold the next 30 seconds' ids: the first call claims a later one, which the
    # second keeps (planned again from the same request, it would name the first second).
    start = datetime.now(UTC)
    taken = {
        new_run_id(f"{start + timedelta(seconds=s):{RUN_STAMP}}", "qwen2.5-1.5b") for s in range(30)
    }
    for run_id in taken:
        (tmp_path / "runs" / run_id).mkdir(parents=True)
    held = _one_gpu(read("other-user-gpu1", proc))
    rc, out = _plan_twice(tmp_path, [held], "-e", "gpu_memory_gib=20")
    assert rc == 0, out[-3000:]
    first, now = json.loads((tmp_path / "results.json").read_text())
    assert first["plan"]["memory"]["gpu_gib"] == 20.0  # -e wins over the facts, as before
    assert now["plan"]["memory"]["gpu_gib"] == 20.0
    assert now["plan"]["memory"]["nodes"]["g1"]["memory_source"].startswith(
        f"gpu_memory_gib (inventory or -e): a share of GPU 0 ({H100}), which other processes"
    )
    assert now["plan"]["memory"]["nodes"]["g1"]["host_memory_gib"] == 96.0
    # The same run: its id (claimed once), nothing checked or made a second time.
    assert now["plan"]["run_id"] == first["plan"]["run_id"]
    assert first["plan"]["run_id"] not in taken
    claimed = {p.name for p in (tmp_path / "runs").iterdir() if p.name.startswith("train-")}
    assert claimed - taken == {first["plan"]["run_id"]}
    assert (first["changed"], now["changed"]) == (True, False)
    assert any("(27.1 GiB free now" in line for line in now["notes"])


def test_planned_again_without_reads_the_plan_is_the_same(tmp_path: Path) -> None:
    # What the first call checked comes back through Ansible's registered result unchanged.
    rc, out = _plan_twice(tmp_path, [])
    assert rc == 0, out[-3000:]
    first, now = json.loads((tmp_path / "results.json").read_text())
    assert (now["plan"], now["notes"]) == (first["plan"], first["notes"])


def test_the_action_refuses_a_held_gpu_after_the_request_was_checked(
    tmp_path: Path, proc: Path
) -> None:
    held = _one_gpu(read("other-user-gpu1", proc))
    rc, out = _plan_twice(tmp_path, [held])
    assert rc != 0
    assert "Other work holds GPUs this run needs" in out
    assert f"GPU 0 ({H100}) is held by pid 48213 (user {pwd.getpwuid(NOBODY).pw_name}:" in out
    assert "-e gpu_memory_gib=N (N <= 27.1" in out


def test_train_yml_reads_every_node_and_plans_the_run_again_for_what_is_free(
    tmp_path: Path,
) -> None:
    # Two CPU nodes on this machine (a local connection): the read runs for real on each, after
    # the request was checked and planned from the facts; the plan is then made again with it.
    local = {"ansible_connection": "local", "cluster_accelerator": "cpu", "nproc_per_node": 1}
    inventory = _inventory(tmp_path, {"a": json.dumps(local)}, {"b": json.dumps(local)})
    rc, out = _train(inventory, "-e", "model=tiny", "--tags", "none", "-v")
    assert rc == 0, out[-3000:]
    task = "TASK [run_config : Run config | "
    read = out.index(f"{task}Read what the GPUs and memory of every node hold now]")
    assert out.index(f"{task}Check the model, datasets, cluster") < read
    assert "ok: [localhost -> a] => (item=a)" in out[read:]
    assert "ok: [localhost -> b] => (item=b)" in out[read:]
    again = out.index(f"{task}Plan the run again for what is free on every node now]")
    assert re.search(r"host_memory_source: available now \((MemAvailable|the cgroup)", out[again:])
    assert out.index(f"{task}Show the plan]") > again
    # -e plan_free_memory=false: the facts alone, no read.
    rc, out = _train(
        inventory, "-e", "model=tiny", "--tags", "none", "-e", "plan_free_memory=false"
    )
    assert rc == 0, out[-3000:]
    assert "ok: [localhost -> a]" not in out
