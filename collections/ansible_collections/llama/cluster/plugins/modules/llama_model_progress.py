#!/usr/bin/python
"""Ansible module: read the status file of a model download (llama-model-fetch) on a node."""

from __future__ import annotations

import json
import os

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: llama_model_progress
short_description: Report how far a model download on this node has got
description:
  - Reads the JSON status file that llama-model-fetch rewrites every few seconds and returns a
    one-line C(progress), whether the download is C(done), and its numbers. Polled with
    C(until) on RV(done), the llama_progress callback prints the line on every retry.
  - Fails (with done true) when the download failed, or when its process is gone (or its
    async job has ended) while the file still says it runs.
options:
  status_file:
    description: The status file the download writes.
    type: path
    required: true
  label:
    description: What is being downloaded, for the progress line (e.g. the hub id).
    type: str
    required: true
  job_file:
    description:
      - The results file of the async job that runs the download (its C(results_file)). A job
        that ended before the status file says so (the downloader could not start) fails here.
    type: path
"""

EXAMPLES = r"""
- name: Follow the model's download on every node
  llama.cluster.llama_model_progress:
    status_file: /opt/llama-cluster/models/.status/qwen.json
    label: Qwen/Qwen2.5-7B-Instruct
    job_file: "{{ download.results_file }}"
  register: progress
  until: progress.done
  retries: 720
  delay: 5
"""

RETURN = r"""
done:
  description: The download has ended (done or failed).
  type: bool
  returned: always
progress:
  description: One line for the play's output.
  type: str
  returned: always
status:
  description: The status file's content (state, files, bytes, rate, error).
  type: dict
  returned: always
"""


def human(size: float) -> str:
    """Bytes as a short human-readable size (1.5 GB)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(size) < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def alive(pid: int) -> bool:
    """True while a process with this pid exists (whoever owns it)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_status(module: AnsibleModule, path: str) -> dict:
    """The status file's content ({} before the downloader has written it)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return {}
    except ValueError as error:
        module.fail_json(msg=f"{path} is not a status file ({error})", done=True)
    return {}


def job_ended(job_file: str | None) -> dict | None:
    """The async job's result once it has ended, else None."""
    if not job_file:
        return None
    try:
        with open(job_file, encoding="utf-8") as handle:
            job = json.load(handle)
    except (OSError, ValueError):  # not written yet, or being written
        return None
    return job if job.get("finished", 1) and "rc" in job else None


def progress_line(label: str, status: dict) -> str:
    """What the play prints for one poll: sizes, files, rate and time left."""
    state = status.get("state", "starting")
    if state in ("starting", "listing"):
        return f"{label}: listing the files"
    total, done = status.get("bytes_total") or 0, status.get("bytes_done") or 0
    rate = status.get("rate") or 0
    line = (
        f"{label}: {human(done)} of {human(total)}"
        f" ({100 * done / total if total else 0:.0f} %), {status.get('files_done', 0)} of"
        f" {status.get('files_total', 0)} files, {human(rate)}/s"
    )
    if state == "downloading" and rate > 0 and total > done:
        line += f", about {max((total - done) / rate / 60, 0.1):.1f} min left"
    if state == "done":
        line += f", done in {status.get('elapsed', 0):.0f} s"
    return line


def main() -> None:
    """Read the status file and report it."""
    module = AnsibleModule(
        argument_spec={
            "status_file": {"type": "path", "required": True},
            "label": {"type": "str", "required": True},
            "job_file": {"type": "path"},
        },
        supports_check_mode=True,
    )
    path, label = module.params["status_file"], module.params["label"]
    status = read_status(module, path)
    state = status.get("state", "starting")
    line = progress_line(label, status)
    if state == "failed":
        module.fail_json(
            msg=f"The download of {label} failed: {status.get('error', 'no reason recorded')}",
            done=True,
            progress=line,
            status=status,
        )
    job = job_ended(module.params["job_file"]) if state != "done" else None
    if job is not None and job.get("rc") == 0:  # it finished between the two reads
        status = read_status(module, path)
        state, line = status.get("state"), progress_line(label, status)
    if job is not None and state != "done":
        said = (job.get("stderr") or job.get("msg") or "").strip().splitlines()[-3:]
        module.fail_json(
            msg=f"The downloader of {label} ended (exit status {job.get('rc')}) without finishing: "
            + (" ".join(said) or "it said nothing"),
            done=True,
            progress=line,
            status=status,
        )
    if status and state != "done" and not alive(int(status.get("pid") or 0)):
        module.fail_json(
            msg=f"The download of {label} stopped without a word (process {status.get('pid')} "
            "is gone: killed, or out of memory). Run the play again: it resumes.",
            done=True,
            progress=line,
            status=status,
        )
    module.exit_json(changed=False, done=state == "done", progress=line, status=status)


if __name__ == "__main__":
    main()
