"""The model staging's filters outside the run_plan action: whether the Hugging Face token may go
to the endpoint the nodes download from, and, where the controller cannot reach the hub and
train.yml asks the master, the headers of that GET and its answer as the action reads it (the
plan itself is made by the run_plan action); and what of a controller's model directory may not
be copied to the nodes (`model_stage_escapes`)."""

from __future__ import annotations

import os
import re
import stat
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    model_stage_answer,
    model_stage_headers,
    model_stage_token_policy,
)

# A snapshot of the Hugging Face cache: its files are links into the repo's blobs/, two up.
HF_SNAPSHOT = re.compile(r"/models--[^/]+/snapshots/[^/]+$")
MAX_NAMED = 5  # the escapes a refusal names


def model_stage_escapes(source: str) -> list[str]:
    """What in a controller's model directory rsync would copy but must not: a link whose target
    leaves the directory (a snapshot of the Hugging Face cache may link into its repo's blobs/,
    no further), one that leads nowhere, and anything that is neither a directory nor a regular
    file (a device, a socket, a pipe). [] when it holds only its own regular files; the first
    MAX_NAMED found, each named with where it leads."""
    root = os.path.realpath(source)
    allowed = os.path.dirname(os.path.dirname(root)) if HF_SNAPSHOT.search(root) else root
    found: list[str] = []
    for folder, dirs, files in os.walk(source):
        for name in [*dirs, *files]:
            path = os.path.join(folder, name)
            problem = _escape(path, allowed)
            if problem:
                found.append(f"{path} {problem}")
                if len(found) >= MAX_NAMED:
                    return found
    return found


def _escape(path: str, allowed: str) -> str:
    """Why one entry may not be copied ('' when it may)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        target = os.path.realpath(path)
        if os.path.commonpath([target, allowed]) != allowed:
            return f"is a link to {target}, outside {allowed}"
        try:
            info = os.stat(path)
        except OSError:
            return f"is a link to {target}, which does not exist"
    if stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode):
        return ""
    return "is neither a directory nor a regular file"


class FilterModule:
    """Where a run's token may go, and the master's question to the hub."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "model_stage_token_policy": model_stage_token_policy,
            "model_stage_headers": model_stage_headers,
            "model_stage_answer": model_stage_answer,
            "model_stage_escapes": model_stage_escapes,
        }
