"""Continuing a run: the checkpoint every node of the run can continue from, and whether a
node's checkpoint is its own ranks' alone (`sharded`, decided once, in the plan).

llama-job applies resume_point before an automatic restart and before a resumed run's first
attempt (module_utils/llama_job/checkpoints.py); status.yml and a failed run's report say with
it which checkpoint a resume would continue from."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# A stage whose checkpoint holds, on each node, only that node's ranks' state (DeepSpeed's ZeRO
# partitions and its per-rank files; FSDP's sharded state): no node can stand in for another.
UNSHARDED_STAGES = frozenset({"none"})


def sharded_checkpoints(stage: str) -> bool:
    """Whether a run of this stage (the plan's `deepspeed`) writes checkpoints that are each
    node's own (the plan's `sharded`)."""
    return stage not in UNSHARDED_STAGES


_CHECKPOINT = re.compile(r"/checkpoint-(\d+)$")
# The Trainer writes trainer_state.json last: a checkpoint without it was cut off mid-save.
_COMPLETE = re.compile(r"/checkpoint-(\d+)/trainer_state\.json$")


def _names(steps: list[int]) -> str:
    return ", ".join(f"checkpoint-{step}" for step in steps) or "none"


def resume_point(
    found: Mapping[str, list[Mapping[str, Any]]],
    run_id: str,
    run_dir: str,
    stamp: str,
    sharded: bool = False,
) -> dict[str, Any]:
    """Pick the checkpoint a run continues from, given what each of its nodes holds.

    found maps every node of the run to the entries `find` listed in its output directory
    (checkpoint-N directories and their trainer_state.json). Every rank loads the checkpoint from
    its own node's disk, so the run continues from the latest complete checkpoint that every node
    has. LLaMA-Factory picks the highest checkpoint-N in output_dir on each node, so newer
    directories (incomplete, or missing on another node) must be set aside first.

    run_dir is the run's directory on every node, stamp names the directory under
    run_dir/set-aside/ that newer checkpoints are moved to; sharded says that each node's
    checkpoint holds only its own ranks' state (DeepSpeed, FSDP), so no node can copy another's.
    Returns ok, step, checkpoint (its name), set_aside (node: names), set_aside_dir, complete and
    incomplete (node: steps), and message (why not, with what to do; or what resuming will do).
    """
    output_dir = f"{run_dir}/output"
    complete: dict[str, list[int]] = {}
    incomplete: dict[str, list[int]] = {}
    for host, entries in found.items():
        dirs = {
            int(m.group(1))
            for e in entries
            if e.get("isdir") and (m := _CHECKPOINT.search(str(e["path"])))
        }
        done = {int(m.group(1)) for e in entries if (m := _COMPLETE.search(str(e["path"])))}
        complete[host] = sorted(dirs & done)
        incomplete[host] = sorted(dirs - done)
    result: dict[str, Any] = {
        "ok": False,
        "step": None,
        "checkpoint": "",
        "set_aside": {},
        "set_aside_dir": f"{run_dir}/set-aside/{stamp}",
        "complete": complete,
        "incomplete": incomplete,
    }
    hosts = list(found)
    common = set.intersection(*(set(steps) for steps in complete.values())) if hosts else set()
    if not common:
        result["message"] = _no_common_checkpoint(complete, incomplete, run_id, output_dir, sharded)
        return result
    step = max(common)
    set_aside = {
        host: [
            f"checkpoint-{s}"
            for s in sorted(set(complete[host]) | set(incomplete[host]))
            if s > step
        ]
        for host in hosts
    }
    set_aside = {host: names for host, names in set_aside.items() if names}
    notes = []
    for host, names in set_aside.items():
        cut = [name for name in names if _step(name) in incomplete[host]]
        newer = [name for name in names if name not in cut]
        parts = [f"{', '.join(newer)} (not on every node)"] if newer else []
        parts += [f"{', '.join(cut)} (cut off while being written)"] if cut else []
        notes.append(f"{' and '.join(parts)} on {host}")
    result.update(ok=True, step=step, checkpoint=f"checkpoint-{step}", set_aside=set_aside)
    result["message"] = (
        f"Resuming {run_id} from checkpoint-{step}, the latest checkpoint that every node has"
        + (f"; moving {'; '.join(notes)} to {result['set_aside_dir']}" if notes else "")
        + "."
    )
    return result


def _step(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


def _no_common_checkpoint(
    complete: dict[str, list[int]],
    incomplete: dict[str, list[int]],
    run_id: str,
    output_dir: str,
    sharded: bool,
) -> str:
    """Why the run cannot resume, and what to do."""
    anywhere = sorted({s for steps in complete.values() for s in steps})
    cut_text = "".join(
        f"; {_names(steps)} on {host} {'has' if len(steps) == 1 else 'have'} no "
        "trainer_state.json (cut off while being written)"
        for host, steps in incomplete.items()
        if steps
    )
    if not anywhere:
        return (
            f"Run {run_id} has no checkpoint yet (save_steps decides how often one is written"
            f"{cut_text}): start a new run instead (ansible-playbook train.yml -e model=...)."
        )
    latest = anywhere[-1]
    holders = sorted(h for h, steps in complete.items() if latest in steps)
    lacking = sorted(h for h, steps in complete.items() if latest not in steps)
    held = "; ".join(f"{h} has {_names(steps)}" for h, steps in complete.items())
    verb = "lacks" if len(lacking) == 1 else "lack"
    if sharded:
        fix = (
            f"each node's checkpoint holds only its own ranks' state (DeepSpeed/FSDP), so another "
            f"node's copy cannot stand in: restore {output_dir} on {', '.join(lacking)} (from a "
            "backup)"
        )
    else:
        fix = (
            f"copy {output_dir}/checkpoint-{latest} from {holders[0]} to the same path on "
            f"{', '.join(lacking)} (e.g. rsync -a as the cluster user), then resume again"
        )
    return (
        f"Run {run_id} cannot resume: no checkpoint is on every node, and every node loads it "
        f"from its own disk. {held}{cut_text}. {', '.join(lacking)} {verb} checkpoint-{latest}: "
        f"{fix}; or start a new run (ansible-playbook train.yml -e model=...)."
    )
