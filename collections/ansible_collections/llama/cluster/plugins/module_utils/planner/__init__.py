"""The run planner: what train.yml runs, decided from the request, the model, every node's GPUs
and the rules kept as data in group_vars/all/training.yml.

One module per concern, each with its unit tests in tests/test_planner.py:

- `schema`: the numbers a user gives, checked against one schema (`TRAIN_ARGS_SCHEMA`,
  `RUN_SCHEMA`), and the project's settings the planner reads (`Settings`);
- `model`: the model from the catalogue, `-e` overrides and its config.json (`model_params`),
  and where it comes from and lives on every node (`model_stage_source`, `model_stage_probe`);
- `nodes`: every node's accelerator, processes and GPU memory from its facts, or from what is
  free on it at train time, refusing a GPU another process holds (`describe_nodes`);
- `memory`: the memory model; `cost`: the predicted step time (compute, optimizer, offload,
  communication; tests/test_cost_model.py); `links`: the link between the nodes from their
  facts or link_gbps (`run_link`);
- `search`: the candidates that fit, ranked by predicted step time, the scaling over 1..N nodes
  and the go/no-go (`ranked`, `scaling`, `assess`);
- `decisions`: micro-batch, accumulation, checkpointing and torch.compile (`choose_batch`,
  `choose_compile`), and the first stage that fits where the cost model does not apply
  (`choose_stage`: CPUs, a model of unknown shape);
- `rules`: the `when`/`set` profile rules kept as data (`apply_rules`);
- `assembly`: `plan` puts it together, with the lines shown before launch;
- `render`: train.yaml's arguments, the dataset registry and the run directory's files;
- `checkpoints`: the checkpoint a resumed run continues from on every node;
- `disk`: the checkpoints kept, their size on every node and whether they fit its free space
  (`disk_estimate`, `disk_budget`; tests/test_disk_budget.py).

The Jinja filters that call it are plugins/filter/run_config.py. Standard library only; errors
are `PlanError` (a filter error in Ansible) that say what to change.
"""
