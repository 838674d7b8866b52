#!/usr/bin/python
"""llama.cluster.run_plan's documentation (ansible-doc -t module llama.cluster.run_plan).

run_plan is an action plugin (plugins/action/run_plan.py): it runs on the controller and never
sends this file to a node. ansible-doc reads an action's documentation from a module of the same
name, as for ansible-core's own actions; the action reads its options from here too, so that the
documented options are the checked ones.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: run_plan
short_description: Check a training request and plan a new run, on the controller
description:
  - Runs in train.yml's first play (localhost) before any node changes, for a new run. Finds the
    model in models_catalogue (one lookup, module_utils/planner/model.py find_model), checks the
    request once (one message lists every bad value, the model's first), the inventory's ranks and
    accelerator.
  - The model's config.json is read on the controller (roles/model_stage/README.md says where
    each kind of model comes from); where only the master can read it, the master is asked
    (O(ask_master), O(hub_answer), O(shared_config)). A generated model (the catalogue's tiny)
    is made first by scripts/make_tiny_model.py, once.
  - In check mode (train.yml --check) nothing is made. No run directory is claimed, a generated
    model not made yet is planned with the config.json it will have (made in a temporary
    directory, removed at once), and the plan's first line names no run.
  - Each dataset (datasets_catalogue, or O(dataset_file)) is checked record by record with
    llama.cluster.llama_dataset_check on the controller.
  - Returns C(plan), which every node renders (roles/run_config), and C(notes), the lines to
    show before launch; fails with the problem and its fix, changing nothing on any node.
  - Reads the project's settings from the play's variables (models_catalogue, datasets_catalogue,
    datasets_formats, datasets_default, training_* (training_shared_storage for the checkpoints'
    disk estimate), the hub settings of group_vars/all/models.yml,
    tiny_model_*, controller_runs_dir, project_dir) and every node's hostvars and facts; a GPU
    node's facts must be gathered or cached before (train.yml reads the missing ones first).
  - With O(node_usage), the GPU and host memory each node has free at train time are planned
    for instead of the facts' totals, and a GPU another process holds is refused naming it
    (module_utils/planner/nodes.py); roles/run_config (tasks/plan.yml) plans from the facts
    first, then again with O(replan) and O(node_usage).
  - The plan is module_utils/planner/plan.py's Plan as JSON (Plan.to_dict), with C(plan.model)
    (its C(path) on every node), C(plan.model_stage) (no secrets in it), C(plan.stage) (its name,
    source and why, and the properties Jinja reads instead of its name), C(plan.technique),
    C(plan.batch), C(plan.memory), C(plan.disk), C(plan.performance), C(plan.version).
options:
  saved:
    description:
      - A run's plan.json, as its text, read back as this release reads plans (of any version,
        module_utils/planner/plan.py's Plan.from_dict) and returned as C(plan); with O(resume),
        the plan of the run continued from its checkpoint. Nothing is checked or planned then;
        every other option but O(resume) and O(max_restarts) is ignored. The default (empty)
        plans a new run.
    type: str
    default: ""
  resume:
    description:
      - With O(saved), the plan of the run continued from its checkpoint (Plan.resumed), with
        resume true, O(max_restarts) restarts, and a model_stage that only checks that the model
        is where the first launch put it.
    type: bool
    default: false
  model:
    description: Catalogue name of the model (-e model), or a name of one's own with O(model_path).
    type: str
    default: ""
  model_path:
    description: Override of the catalogue's path (a hub id, or a directory).
    type: str
    default: ""
  model_revision:
    description:
      - Hub revision (branch, tag or commit); default main (Hugging Face) or master (ModelScope).
    type: str
    default: ""
  model_shared:
    description: The path is a directory at the same path on every node (shared storage).
    type: bool
    default: false
  shared_config:
    description:
      - config.json of a model on shared storage that the controller does not mount, base64, as
        ansible.builtin.slurp read it on the master ("" = none read).
    type: str
    default: ""
  ask_master:
    description:
      - true, for a model on shared storage whose config.json is neither on the controller nor in
        O(shared_config), returns C(read_on_master) (that config.json's path) instead of failing,
        and plans nothing; the play reads it on the master and calls the action again with
        O(shared_config) (train.yml does). false refuses, naming the master.
      - true, for a hub id the controller gets no answer about (no connection, or a 5xx),
        returns C(hub_on_master) instead, and plans nothing; the play asks the hub from the
        master and calls the action again with O(hub_answer) (train.yml does). false plans
        without the hub where the size is known (see the description), else refuses.
    type: bool
    default: false
  hub_answer:
    description:
      - The hub's answer to the master's GET of C(hub_on_master.url), as ansible.builtin.uri
        registered it, reduced by the filter llama.cluster.model_stage_answer (no request
        headers, so no token); {} = the master was not asked.
    type: raw
    default: {}
  probe_model:
    description:
      - false plans from the catalogue alone, offline (no hub request, nothing generated, no
        config.json read); the plan then has no model_stage.
    type: bool
    default: true
  claim_run_id:
    description:
      - true (train.yml) makes a new run's directory under controller_runs_dir once it is
        planned, so that no other run started from this controller takes the same id; a run
        planned in the same second as another gets the next free second's id. Not in check mode.
    type: bool
    default: false
  run_id:
    description:
      - -e run_id as given. A new run's id is made by the plan, so a run id given is refused,
        naming -e resume=true (which continues the run it names) instead of being replaced.
    type: str
    default: ""
  model_template:
    description:
      - Override of the model's chat template, one of LLaMA-Factory's
        (module_utils/planner/llamafactory_names.json).
    type: str
    default: ""
  finetuning_type:
    description: Override of the fine-tuning type (lora, freeze, full).
    type: str
    default: ""
  lora_target:
    description: Override of the LoRA target modules.
    type: str
    default: ""
  cutoff_len:
    description: Override of the cutoff length, an integer >= 1 (0 keeps the catalogue's).
    type: raw
    default: 0
  model_params_b:
    description:
      - The model's size in billions of parameters ("" = the catalogue's, or counted from
        config.json).
    type: raw
    default: ""
  trust_remote_code:
    description: Run the model's own modelling code (needed when its config.json has auto_map).
    type: raw
    default: false
  deepspeed:
    description:
      - auto, none, zero0, zero1, zero2, zero2_offload, zero3, zero3_hpz (ZeRO++ hpZ),
        zero3_offload, fsdp or hsdp (FSDP's hybrid shard) (default training_deepspeed); the
        hybrid zero3_hpz and hsdp need several nodes of several processes each.
    type: str
  quantization_bit:
    description:
      - 4 trains QLoRA (LoRA on 4-bit frozen weights, bitsandbytes); 0 (default) lets the planner
        choose QLoRA only for a LoRA run whose bf16 weights fit the GPU only offloaded.
    type: raw
    default: 0
  numerics:
    description:
      - measured (the search may choose a change of numerics measured to follow fp32 AdamW's
        loss, such as 8-bit AdamW or a QLoRA fallback) or exact (none); "" = training_numerics.
    type: str
    default: ""
  train_args:
    description:
      - LLaMA-Factory training arguments (a mapping) that win over every default. Each key must
        be one of LLaMA-Factory's argument names (module_utils/planner/llamafactory_names.json),
        and not one refused by its category (TRAIN_ARGS_REFUSED in
        module_utils/planner/schema.py, docs/security.md), what the plan sets (output_dir,
        resume_from_checkpoint, ...), what would leave the cluster (push_to_hub, ...) or reach
        outside the run's directory (cache_dir, ...); each refusal names the way to set it.
        report_to names only tensorboard, wandb, mlflow or swanlab.
    type: raw
    default: {}
  tokens_per_step:
    description:
      - Tokens per process per optimizer step, an integer >= 1 (default training_tokens_per_step).
    type: raw
  allow_slow_scaling:
    description:
      - Train even where the cost model predicts that the nodes would train slower than fewer
        nodes, or below 60 % of linear scaling (otherwise refused before launch).
    type: raw
    default: false
  fp8:
    description:
      - Train in FP8 (torchao float8 linear layers) on GPUs of compute capability 8.9 or newer,
        with plain DDP and torchao installed on every node (llamafactory_extras); refused
        elsewhere, naming the nodes.
    type: raw
    default: false
  max_restarts:
    description:
      - Restarts allowed after a failure, an integer >= 0 (recorded in the plan; with O(resume),
        the resumed run's).
    type: raw
    default: 0
  min_nodes:
    description:
      - The fewest nodes the run may continue on when others stay away past the restart window
        (C(-e min_nodes=N); 0, the default, is every node). The run is planned again for every
        count from N up to the cluster's less one (the plan's C(fewer_nodes), the same effective
        batch through accumulation, memory checked again); a count whose plan does not fit, or a
        plan whose checkpoints are sharded, is refused.
    type: int
    default: 0
  replan:
    description:
      - This action's result for the same request (registered by an earlier call), to plan it
        again, e.g. with O(node_usage). The request, model and datasets that call checked are
        planned as they are (no second hub request, dataset check or model generation) and the
        run keeps the id that call gave it; every other option but O(node_usage) is ignored.
      - "{} (the default): check the request and plan it."
    type: dict
    default: {}
  node_usage:
    description:
      - What llama.cluster.llama_node_usage read on the nodes just before, as the task looped over
        them registers it (its C(results); each names its node as C(item)). A node without a
        result (not read, unreachable, failed) is planned from its facts. [] plans every node from
        its facts.
    type: list
    elements: raw
    default: []
  dataset:
    description:
      - Catalogue dataset names, comma-separated ("" = datasets_default, unless O(dataset_file)).
    type: str
    default: ""
  dataset_file:
    description: A dataset file on the controller, instead of (or added to) catalogue entries.
    type: str
    default: ""
  dataset_format:
    description: Format of O(dataset_file), a key of datasets_formats (alpaca, sharegpt, openai).
    type: str
    default: alpaca
  dataset_skip_invalid:
    description:
      - Train on the valid records of a dataset that has invalid ones (written to
        controller_runs_dir/datasets/) instead of failing (default dataset_skip_invalid).
    type: raw
author: llama-cluster
"""

EXAMPLES = r"""
- name: Train | Check the request and plan the run
  llama.cluster.run_plan:
    model: "{{ model | default('') }}"
    dataset: "{{ dataset | default('') }}"
  register: planned
"""

RETURN = r"""
plan:
  description:
    - The run (roles/run_config renders it), with model (model.path is train.yaml's
      model_name_or_path) and model_stage, the staging request. Absent with read_on_master.
  type: dict
read_on_master:
  description:
    - With O(ask_master), the config.json to read on the master, for a model on shared storage that
      the controller does not mount; nothing was planned.
  type: str
hub_on_master:
  description:
    - With O(ask_master), the GET the master makes for a hub id that the controller got no answer
      about; nothing was planned. C(url), C(token_variable) (the variable holding the hub's
      token) and C(send_token) (whether the token may go to that endpoint).
  type: dict
notes:
  description: Where the model comes from, what a dataset check left out, then the plan's summary.
  type: list
checked:
  description:
    - What was checked and planned (the request, the model, the datasets, the staging request,
      the notes before the summary, the run id), for a later call's O(replan). Absent with
      read_on_master.
  type: dict
"""
