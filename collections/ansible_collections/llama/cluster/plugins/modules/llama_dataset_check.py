#!/usr/bin/python
"""Ansible module: check a dataset file record by record, as LLaMA-Factory reads it."""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llama.cluster.plugins.module_utils.dataset_check import (
    DatasetFileError,
    EntryError,
    build_spec,
    check_file,
    file_problem,
    summary,
)

DOCUMENTATION = r"""
module: llama_dataset_check
short_description: Check a dataset file for LLaMA-Factory 0.9.5, record by record
description:
  - Reads a JSON list of records or a JSON Lines file as a stream (memory stays bounded whatever
    the file's size) and checks every record the way LLaMA-Factory's converter for its format
    reads it (data/converter.py, data/parser.py), including the cases where LLaMA-Factory
    silently skips a record or stops with an error that names neither the file nor the record.
  - Fails naming the file, the first few bad records (index counted from 0, and line) and what
    is wrong with each, and the total count. With O(skip_invalid), writes the valid records to
    O(valid_out) (JSON Lines) and returns that file to train on, with the count and the first
    indexes it left out.
options:
  path:
    description: The dataset file.
    type: path
    required: true
  name:
    description: The dataset's name, used in messages.
    type: str
    default: dataset
  formatting:
    description: LLaMA-Factory's formatting of the dataset_info entry.
    type: str
    choices: [alpaca, sharegpt, openai]
    default: alpaca
  columns:
    description:
      - The entry's column mapping. As in LLaMA-Factory, a given mapping replaces every default
        (a column it leaves out is not read); omitted, the defaults apply.
    type: dict
  tags:
    description: The entry's sharegpt tags; the same rule as O(columns).
    type: dict
  ranking:
    description: The entry's ranking flag (preference data).
    type: bool
    default: false
  skip_invalid:
    description: Train on the valid records instead of failing when some are invalid.
    type: bool
    default: false
  valid_out:
    description: Where the valid records go with O(skip_invalid) when some are invalid.
    type: path
  max_errors:
    description: How many bad records a message lists.
    type: int
    default: 5
  max_record_mib:
    description: The largest record (or JSON Lines line) read, in MiB.
    type: int
    default: 64
author: llama-cluster
"""

EXAMPLES = r"""
- name: Check the dataset
  llama.cluster.llama_dataset_check:
    name: demo_sharegpt
    path: data/demo_sharegpt.json
    formatting: sharegpt
    columns: {messages: conversations}

- name: Train on the valid records of a file with some bad ones
  llama.cluster.llama_dataset_check:
    name: mine
    path: /data/mine.jsonl
    skip_invalid: true
    valid_out: /tmp/mine.valid.jsonl
  register: checked
# checked.file is the file to train on; checked.invalid_indexes the first records left out
"""

RETURN = r"""
records:
  description: Records in the file.
  type: int
  returned: always
valid:
  description: Records LLaMA-Factory can train on.
  type: int
  returned: always
invalid:
  description: Records that are not valid.
  type: int
  returned: always
invalid_indexes:
  description: Indexes (from 0) of the first invalid records.
  type: list
  returned: always
errors:
  description: One line per listed invalid record, C(record N (line L) - problem).
  type: list
  returned: always
file:
  description: The file to train on (O(path), or O(valid_out) when records were left out).
  type: str
  returned: always
file_format:
  description: json (a list of records) or jsonl (one record per line).
  type: str
  returned: always
warnings_text:
  description: Keys the records carry that the entry does not map (LLaMA-Factory ignores them).
  type: list
  returned: always
"""


def main() -> None:
    """Run the module."""
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "name": {"type": "str", "default": "dataset"},
            "formatting": {
                "type": "str",
                "default": "alpaca",
                "choices": ["alpaca", "sharegpt", "openai"],
            },
            "columns": {"type": "dict"},
            "tags": {"type": "dict"},
            "ranking": {"type": "bool", "default": False},
            "skip_invalid": {"type": "bool", "default": False},
            "valid_out": {"type": "path"},
            "max_errors": {"type": "int", "default": 5},
            "max_record_mib": {"type": "int", "default": 64},
        },
        supports_check_mode=True,
    )
    params = module.params
    name, path = params["name"], params["path"]
    problem = file_problem(path)
    if problem:
        module.fail_json(
            msg=f"Dataset {name}: {path} {problem}. Give the dataset's file: fix `file` in "
            "group_vars/all/datasets.yml or the -e dataset_file path."
        )
    try:
        spec = build_spec(
            params["formatting"], params["columns"], params["tags"], params["ranking"]
        )
    except EntryError as err:
        module.fail_json(msg=f"Dataset {name}: {err} (group_vars/all/datasets.yml)")
    skip = params["skip_invalid"]
    writes = skip and params["valid_out"] and not module.check_mode
    try:
        report = check_file(
            path,
            spec,
            valid_out=params["valid_out"] if writes else None,
            max_errors=params["max_errors"],
            max_record_bytes=params["max_record_mib"] << 20,
        )
    except DatasetFileError as err:
        module.fail_json(
            msg=f"Dataset {name}: {path} {err}. Fix the file (python3 -m json.tool {path} shows "
            "where, for a JSON list) and run again."
        )
    except OSError as err:
        module.fail_json(msg=f"Dataset {name}: cannot read {path}: {err.strerror}.")
    result = {
        "records": report.records,
        "valid": report.valid,
        "invalid": report.invalid,
        "invalid_indexes": report.invalid_indexes,
        "errors": report.errors,
        "file_format": report.file_format,
        "warnings_text": report.warnings,
        "file": params["valid_out"] if report.written else path,
        "changed": report.written,
    }
    if not report.records:
        module.fail_json(msg=f"Dataset {name}: {path} holds no records.")
    if report.problems:
        module.fail_json(msg=f"Dataset {name}: {path}: {'; '.join(report.problems)}.")
    if report.invalid and (not skip or not report.valid):
        module.fail_json(msg=summary(name, path, report, False, spec))
    result["msg"] = (
        summary(name, path, report, True, spec)
        if report.invalid
        else f"Dataset {name}: {report.records} valid {spec.formatting} records in {path}."
    )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
