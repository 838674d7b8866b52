"""Continuing a run: the checkpoint every node of the run can continue from (`resume_point`).

llama-job's master applies it before an automatic restart and before a resumed run's first
attempt (checkpoints.py: continue_plan); the controller's filters (status.yml, a failed run's
report) say with it which checkpoint a resume would continue from. Stdlib only, Python 3.10."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

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

    found maps every node of the run to the entries listed in its output directory
    (checkpoint-N directories and their trainer_state.json: llama-job's `listing`, which leaves
    out the trainer_state.json of a checkpoint whose files do not parse or match their index and
    says why in the directory's `problem`; or `find`'s). Every rank loads the checkpoint from
    its own node's disk, so the run continues from the latest complete checkpoint that every node
    has. LLaMA-Factory picks the highest checkpoint-N in output_dir on each node, so newer
    directories (incomplete, or missing on another node) must be set aside first.

    run_dir is the run's directory on every node, stamp names the directory under
    run_dir/set-aside/ that newer checkpoints are moved to; sharded says that each node's
    checkpoint holds only its own ranks' state (DeepSpeed, FSDP), so no node can copy another's.
    Returns ok, step, checkpoint (its name), set_aside (node: names), set_aside_dir, complete and
    incomplete (node: steps), why (node: {incomplete checkpoint: why}), and message (why not,
    with what to do; or what resuming will do).
    """
    output_dir = f"{run_dir}/output"
    complete: dict[str, list[int]] = {}
    incomplete: dict[str, list[int]] = {}
    problems: dict[tuple[str, int], str] = {}
    for host, entries in found.items():
        dirs = {
            int(m.group(1))
            for e in entries
            if e.get("isdir") and (m := _CHECKPOINT.search(str(e["path"])))
        }
        done = {int(m.group(1)) for e in entries if (m := _COMPLETE.search(str(e["path"])))}
        for e in entries:
            if e.get("isdir") and e.get("problem") and (m := _CHECKPOINT.search(str(e["path"]))):
                problems[host, int(m.group(1))] = str(e["problem"])
        done -= {step for (where, step) in problems if where == host}
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
        # node: {checkpoint-N: why it is incomplete}
        "why": {
            host: {f"checkpoint-{s}": problems.get((host, s), _CUT) for s in steps}
            for host, steps in incomplete.items()
            if steps
        },
    }
    hosts = list(found)
    common = set.intersection(*(set(steps) for steps in complete.values())) if hosts else set()
    if not common:
        cut_text = _cut_text(incomplete, problems)
        result["message"] = _no_common_checkpoint(complete, cut_text, run_id, output_dir, sharded)
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
        whys: dict[str, list[str]] = {}
        for name in cut:
            whys.setdefault(problems.get((host, _step(name)), _CUT), []).append(name)
        parts += [f"{', '.join(cut_names)} ({why})" for why, cut_names in whys.items()]
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


_CUT = "cut off while being written"


def _cut_text(incomplete: dict[str, list[int]], problems: Mapping[tuple[str, int], str]) -> str:
    """The incomplete checkpoints of every node, each with why."""
    parts = []
    for host, steps in incomplete.items():
        bare = [s for s in steps if (host, s) not in problems]
        if bare:
            verb = "has" if len(bare) == 1 else "have"
            parts.append(f"; {_names(bare)} on {host} {verb} no trainer_state.json ({_CUT})")
        parts += [
            f"; checkpoint-{s} on {host} is incomplete: {problems[host, s]}"
            for s in steps
            if (host, s) in problems
        ]
    return "".join(parts)


def _no_common_checkpoint(
    complete: dict[str, list[int]],
    cut_text: str,
    run_id: str,
    output_dir: str,
    sharded: bool,
) -> str:
    """Why the run cannot resume (cut_text: the incomplete checkpoints, _cut_text), and what
    to do."""
    anywhere = sorted({s for steps in complete.values() for s in steps})
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
