"""The run planner: what train.yml runs, decided from the request, the model, every node's GPUs
and the rules kept as data in group_vars/all/training.yml.

One module per concern (the collection's README lists each, and tests/unit/project/test_maps.py
checks that
list and that the planner imports nothing outside itself but the standard library and
ansible.errors):

- `plan`: the plan's protocol, as llama_job/protocol.py is the status's: `Stage` (what each
  DeepSpeed stage is, its name spelt there alone), the one search order per fine-tuning type,
  `Request`, `StageChoice`, `Plan` (its JSON of every version, `resumed`) and `RunReport`;
- `schema`: the numbers a user gives, checked against one schema (`check_request`), and the
  project's settings the planner reads (`Settings`);
- `model`: the model from the catalogue (`find_model`), `-e` overrides and its config.json
  (`resolve_model`), and where it comes from and lives on every node (`model_stage_source`);
- `nodes`: every node's accelerator, processes and GPU memory from its facts, or from what is
  free on it at train time, refusing a GPU another process holds (`describe_nodes`);
- `memory` and `measured_memory`: the memory model; `cost`: the predicted step time
  (tests/unit/planner/test_cost_model.py); `links`: the link between the nodes (`run_link`);
- `techniques`: the memory-saving techniques the search tries besides the stages (8-bit AdamW,
  Liger, QLoRA) and the numerics policy that allows or forbids them (`candidates`);
- `search`: the candidates that fit, ranked by predicted step time, the scaling over 1..N nodes
  and the go/no-go (`ranked`, `scaling`, `assess`);
- `decisions`: the stage, by one rule (`choose_stage`: the search's fastest candidate of the
  stage asked for or of every stage, else the first of the search order that fits), micro-batch,
  accumulation, checkpointing, torch.compile and FP8 (`choose_batch`, `choose_compile`,
  `choose_fp8`);
- `rules`: the `when`/`set` profile rules kept as data (`apply_rules`);
- `assembly`: `assemble`, a pipeline over one context (the stage, the technique, the batch, then
  the plan); `summary`: the lines shown before launch;
- `disk`: the checkpoints kept, their size on every node and whether they fit its free space
  (`disk_estimate`, `disk_budget`; tests/unit/planner/test_disk_budget.py);
- `errors`: `PlanError`, the one error (a filter error in Ansible) that says what to change.

The action that calls it is plugins/action/run_plan.py; the filters that render a plan are
plugins/filter/run_config.py. Standard library only.
"""
