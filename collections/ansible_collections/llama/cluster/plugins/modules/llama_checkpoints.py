#!/usr/bin/python
"""Ansible module: a run's checkpoints on this node, each complete or not, by llama-job's rule."""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.checkpoints import listing

DOCUMENTATION = r"""
module: llama_checkpoints
short_description: A run's checkpoints on this node, each complete or not
description:
  - Lists the checkpoint-N directories of O(directory) (the newest 40; a link is not one) the
    way the master's llama-job agent does before it continues a run, so that train.yml's
    resume check and a failed run's report pick the checkpoint it will pick.
  - A checkpoint is complete (whole) when its trainer_state.json parses, every weight index
    (C(*.index.json)) parses and every shard it names is there, every safetensors file holds the
    bytes its header says, every torch file (C(*.pt), C(*.pth), C(*.bin)) ends with its zip
    archive's end record, DeepSpeed's C(latest) names a state holding every rank's shards, and,
    where the run declares markers (C(llama_job_markers.json) in O(directory), written by the
    job's trainer callback), its C(llama_job_saved.json) lists every file with its size
    (llama_job/whole.py). One that is not is listed with why (C(problem)), without its
    trainer_state.json.
  - Read-only, in check mode too; nothing is read through a link.
options:
  directory:
    description: The run's output directory on this node (<run dir>/output).
    type: path
    required: true
author: llama-cluster
"""

EXAMPLES = r"""
- name: List the run's checkpoints on every node
  llama.cluster.llama_checkpoints:
    directory: /opt/llama-cluster/runs/train-20261204-101500-tiny/output
  register: checkpoints
# checkpoints.files: [{path: .../checkpoint-10, isdir: true},
#                     {path: .../checkpoint-10/trainer_state.json, isdir: false},
#                     {path: .../checkpoint-15, isdir: true,
#                      problem: "trainer_state.json is empty or does not parse ..."}]
"""

RETURN = r"""
files:
  description:
    - Each checkpoint-N directory (path, isdir true; problem where it is incomplete) and, for
      a complete one, its trainer_state.json (path, isdir false), as the filters job_resume and
      job_run_summary read them (llama_job's checkpoints.listing).
  type: list
  elements: dict
  returned: always
"""


def main() -> None:
    """Entry point."""
    module = AnsibleModule(
        argument_spec={"directory": {"type": "path", "required": True}},
        supports_check_mode=True,
    )
    module.exit_json(changed=False, files=listing(module.params["directory"]))


if __name__ == "__main__":
    main()
