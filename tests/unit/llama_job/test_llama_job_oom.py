"""llama-job's oom.py: what a failed attempt ran out of (the kernel's OOM killer, a GPU's memory),
from cgroup counters, the kernel log and the command's output, and the words that say it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    oom,
)

# What a node's kernel logs when its OOM killer ends a rank (a global OOM, Linux 5.x/6.x).
KERNEL_OOM_LOG = """\
python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0
Mem-Info:
oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,global_oom,task_memcg=/system.slice/llama-t-rank0.service,task=python3,pid=8393,uid=1000
Out of memory: Killed process 8393 (python3) total-vm:141029376kB, anon-rss:126877696kB, file-rss:81920kB, shmem-rss:0kB, UID:1000 pgtables:250112kB oom_score_adj:0
oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/other,task_memcg=/other,task=java,pid=777,uid=1001
"""  # noqa: E501 - the kernel's lines as it writes them
# torchrun once the kernel killed its rank 0 (pid 8393).
TORCHRUN_KILLED = """\
E1201 11:32:46 api.py:986] failed (exitcode: -9) local_rank: 0 (pid: 8393) of binary: python3
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_11:32:46
  host      : node1
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 8393)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 8393
"""
CUDA_OOM_LINE = (
    "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.30 GiB. GPU 0 has a "
    "total capacity of 79.10 GiB of which 400.00 MiB is free. Including non-PyTorch memory, this "
    "process has 78.69 GiB memory in use."
)


def test_the_kernel_log_names_the_oom_killer_s_victim_in_both_line_formats():
    assert oom.kernel_oom_kills(KERNEL_OOM_LOG, {8393}, uid=1000) == [
        {"pid": 8393, "process": "python3", "uid": 1000, "rss": 126877696 * 1024}
    ]
    summary_only = "\n".join(line for line in KERNEL_OOM_LOG.splitlines() if "Killed" not in line)
    assert oom.kernel_oom_kills(summary_only, {8393}) == [
        {"pid": 8393, "process": "python3", "uid": 1000, "rss": None}
    ]
    cgroup_line = "Memory cgroup out of memory: Killed process 512 (python) anon-rss:65152kB, UID:0"
    assert oom.kernel_oom_kills(cgroup_line, {512})[0]["rss"] == 65152 * 1024
    assert oom.kernel_oom_kills(KERNEL_OOM_LOG, {8394}) == []  # another process was killed
    assert oom.kernel_oom_kills(KERNEL_OOM_LOG, {8393}, uid=1001) == []  # a pid used again since


def test_the_processes_a_launcher_reports_failed_carry_rank_and_pid():
    assert oom.reported_failures(TORCHRUN_KILLED) == [{"rank": 0, "exit_status": -9, "pid": 8393}]
    agent_only = TORCHRUN_KILLED.splitlines()[0]
    assert oom.reported_failures(agent_only) == [{"rank": None, "exit_status": -9, "pid": 8393}]
    assert oom.reported_failures("rank : 0 (local_rank: 0)\n exitcode : 0 (pid: 5)") == []


def test_the_memory_cgroup_of_a_unit_is_found_for_cgroup_v2_and_v1(tmp_path: Path):
    v2 = "0::/system.slice/llama-t-rank0.service\n"
    assert oom.cgroup_dir(v2, tmp_path) == tmp_path / "system.slice/llama-t-rank0.service"
    assert oom.unit_cgroup("llama-t-rank0", v2, tmp_path) == tmp_path / v2[4:].strip()
    v1 = "12:pids:/x\n4:memory:/system.slice/llama-t-rank0.service\n0::/system.slice/x\n"
    assert oom.cgroup_dir(v1, tmp_path) == tmp_path / "memory/system.slice/llama-t-rank0.service"
    session = "0::/user.slice/user-1000.slice/session-4.scope\n"
    assert oom.unit_cgroup("llama-t-rank0", session, tmp_path) is None  # not a cgroup of the job's


def test_oom_kill_counters_are_read_from_memory_events_oom_control_and_vmstat(tmp_path: Path):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    v1.mkdir()
    (v2 / "memory.events").write_text(
        "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n"
    )
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 1234\noom_kill 7\n")
    assert oom.oom_counters(v2, vmstat) == {"node": 7, "cgroup": 1}
    assert oom.oom_counters(v1, vmstat) == {"node": 7, "cgroup": 3}
    assert oom.oom_counters(None, tmp_path / "absent") == {"node": None, "cgroup": None}


def _no_log() -> str:
    raise AssertionError("the kernel log is read only when a counter says the OOM killer ran")


def test_an_oom_kill_needs_a_counter_that_rose_or_the_kernel_log_naming_a_job_pid():
    def log() -> str:
        return KERNEL_OOM_LOG

    unit = oom.oom_kill_evidence(
        {"node": 0, "cgroup": 0}, {"node": 1, "cgroup": 1}, log, {8393}, 1000
    )
    assert unit == {"source": "cgroup", "victim": oom.kernel_oom_kills(KERNEL_OOM_LOG, {8393})[0]}
    flat = ({"node": 4, "cgroup": 2}, {"node": 5, "cgroup": 2})  # another cgroup's process
    assert oom.oom_kill_evidence(*flat, _no_log, {8393}, 1000) is None
    session = ({"node": 4, "cgroup": None}, {"node": 4, "cgroup": None})
    assert oom.oom_kill_evidence(*session, _no_log, {8393}, 1000) is None
    ran = ({"node": 4, "cgroup": None}, {"node": 5, "cgroup": None})
    assert oom.oom_kill_evidence(*ran, log, {8393}, 1000)["source"] == "kernel log"
    assert oom.oom_kill_evidence(*ran, log, {9000}, 1000) is None  # the killer chose another
    assert oom.oom_kill_evidence(*ran, lambda: None, {8393}, 1000) == {
        "source": "node",
        "victim": None,
    }
    assert oom.oom_kill_evidence({}, {}, lambda: "", {8393}, 1000) is None  # no counters, no line


def test_memory_figures_come_from_meminfo_and_the_unit_s_cgroup(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       134217728 kB\nMemFree:         1024 kB\n")
    unit = tmp_path / "unit"
    unit.mkdir()
    (unit / "memory.max").write_text("max\n")
    (unit / "memory.peak").write_text(f"{126 << 30}\n")
    assert oom.memory_figures(unit, meminfo=meminfo, root=tmp_path) == {
        "total": 128 << 30,
        "limit": None,
        "limit_cgroup": None,
        "unit_limited": False,
        "peak": 126 << 30,
    }
    (unit / "memory.max").write_text(f"{30 << 30}\n")
    limited = oom.memory_figures(unit, meminfo=meminfo, root=tmp_path)
    assert (limited["limit"], limited["limit_cgroup"], limited["unit_limited"]) == (
        30 << 30,
        "/unit",
        True,
    )
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.max_usage_in_bytes").write_text("1073741824\n")
    assert oom.memory_figures(v1, meminfo=meminfo)["limit"] is None
    assert oom.memory_figures(v1, meminfo=meminfo)["peak"] == 1 << 30
    assert oom.memory_figures(None, meminfo=tmp_path / "absent") == {
        "total": None,
        "limit": None,
        "limit_cgroup": None,
        "unit_limited": False,
        "peak": None,
    }


def _cgroup(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text + "\n")
    return directory


def test_the_limit_is_the_tightest_of_the_process_s_cgroup_and_its_parents(tmp_path: Path):
    """A lab node: a 1.5 GiB container on a 23.5 GiB machine, the job's unit below it."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {int(23.5 * (1 << 20))} kB\n")
    unit_path = "docker/abc/system.slice/llama-t-rank0.service"
    hierarchies = (  # cgroup v2, then v1: the limit's file, the peak's, "no limit", /proc's line
        (tmp_path / "v2", tmp_path / "v2", "memory.max", "memory.peak", "max", "0:"),
        (tmp_path / "v1", tmp_path / "v1/memory", "memory.limit_in_bytes",
         "memory.max_usage_in_bytes", "9223372036854771712", "4:memory"),
    )  # fmt: skip
    for root, top, limit, peak, unlimited, line in hierarchies:
        _cgroup(top, {limit: unlimited})
        _cgroup(top / "docker/abc", {limit: str(3 << 29), peak: str(1503 << 20)})
        unit = _cgroup(top / unit_path, {limit: unlimited})
        if limit == "memory.limit_in_bytes":  # v1 states the inherited limit in every child
            (unit / "memory.stat").write_text(f"cache 0\nhierarchical_memory_limit {3 << 29}\n")
        proc = f"{line}:/{unit_path}\n"
        assert oom.memory_limit(proc, root) == (3 << 29, top / "docker/abc")
        figures = oom.memory_figures(unit, proc, meminfo, root)
        assert figures == {
            "total": int(23.5 * (1 << 30)),
            "limit": 3 << 29,
            "limit_cgroup": "/docker/abc",
            "unit_limited": False,
            "peak": 1503 << 20,
        }
        cause = oom.host_oom_cause({"source": "cgroup", "victim": None}, [], figures)
        assert oom.describe_cause({**cause, "rank": 1}, "node2") == (
            "the kernel killed rank 1 on node2 for host memory: 1.5 of 1.5 GiB in use (the memory "
            "limit of cgroup /docker/abc; OOM killer)"
        )
    # A high-water mark from before the limit was lowered is the limit when it killed.
    (tmp_path / "v1/memory/docker/abc/memory.max_usage_in_bytes").write_text(f"{5 << 30}\n")
    proc = f"4:memory:/{unit_path}\n"
    assert oom.memory_figures(None, proc, meminfo, tmp_path / "v1")["peak"] == 3 << 29
    # Inside a container's own view of v1, its cgroup is the hierarchy's root, and its parents'
    # limits show only in memory.stat.
    stat = f"cache 0\nhierarchical_memory_limit {3 << 29}\n"
    own = _cgroup(
        tmp_path / "own/memory",
        {"memory.limit_in_bytes": "9223372036854771712", "memory.stat": stat},
    )
    assert oom.memory_limit(f"4:memory:/{unit_path}\n", tmp_path / "own") == (3 << 29, own)
    # No limit anywhere: the node's RAM is the budget.
    assert oom.memory_limit("0::/\n", tmp_path / "v2") is None
    assert oom.memory_limit("", tmp_path) is None


def _gib(tried: float, free: float, total: float) -> dict[str, float]:
    return {"tried_gib": tried, "free_gib": free, "total_gib": total}


def test_a_cuda_oom_line_gives_the_rank_and_the_gpu_s_figures():
    cause = oom.cuda_oom(f"step 40\n{CUDA_OOM_LINE}\nChildFailedError\n", [])
    assert cause == {"kind": "gpu_oom", "rank": 1, "gpu": 0, **_gib(2.3, 0.4, 79.1)}
    older = (
        "RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 3; 15.90 GiB total "
        "capacity; 13.13 GiB already allocated; 0 bytes free; 14.80 GiB reserved in total)"
    )
    failed = [{"rank": 5, "exit_status": 1, "pid": 10}]
    assert oom.cuda_oom(older, failed) == {
        "kind": "gpu_oom",
        "rank": 5,
        "gpu": 3,
        **_gib(0.5, 0, 15.9),
    }
    assert oom.cuda_oom("RuntimeError: NCCL error", failed) is None


def test_the_cause_is_said_with_the_rank_the_node_and_the_figures():
    kernel_log = oom.oom_kill_evidence(
        {"node": 0}, {"node": 1}, lambda: KERNEL_OOM_LOG, {8393}, 1000
    )
    failures = oom.reported_failures(TORCHRUN_KILLED)
    host = {"total": 128 << 30, "limit": None, "peak": None}
    cause = oom.host_oom_cause(kernel_log, failures, host)
    assert (cause["rank"], cause["pid"], cause["source"]) == (0, 8393, "kernel log")
    assert oom.describe_cause(cause, "node1") == (
        "the kernel killed rank 0 on node1 for host memory: it held 121.0 of 128.0 GiB (OOM killer)"
    )
    unit = oom.host_oom_cause(
        {"source": "cgroup", "victim": None}, failures, {**host, "peak": 126 << 30}
    )
    assert oom.describe_cause(unit, "node1") == (
        "the kernel killed rank 0 on node1 for host memory: 126.0 of 128.0 GiB in use (OOM killer)"
    )
    limited = oom.host_oom_cause(
        {"source": "cgroup", "victim": None},
        [],
        {"total": 128 << 30, "limit": 8 << 30, "peak": 8 << 30, "unit_limited": True},
    )
    assert oom.describe_cause(limited, "node1") == (
        "the kernel killed a process of the job on node1 for host memory: 8.0 of 8.0 GiB in use "
        "(its unit's memory limit; OOM killer)"
    )
    unread = oom.host_oom_cause({"source": "node", "victim": None}, failures, host)
    assert oom.describe_cause(unread, "node1").startswith(
        "rank 0 on node1 was killed as the kernel's OOM killer ran there (host memory: 128.0 GiB;"
    )
    gpu = oom.cuda_oom(CUDA_OOM_LINE, [])
    assert oom.describe_cause(gpu, "node2", step=40) == (
        "rank 1 on node2 ran out of GPU memory after step 40: tried to allocate 2.3 GiB, 0.4 of "
        "79.1 GiB free"
    )


def test_a_sigkilled_process_the_kernel_log_does_not_name_is_no_oom_kill():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.time()
    victim.kill()
    assert victim.wait() == -signal.SIGKILL
    # Whatever this machine's kernel log holds (or if this user cannot read it), it names no
    # OOM kill of this pid: the counters left unknown, the log alone decides.
    log = oom.read_kernel_log(started - 1)
    assert oom.oom_kill_evidence({}, {}, lambda: log, {victim.pid}, os.getuid()) is None
