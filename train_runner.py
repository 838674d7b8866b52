"""llama-cluster from Python: every playbook as a method with a structured result, and a CLI.

    from train_runner import Cluster
    cluster = Cluster()                       # the lab: inventory/lab.yml
    cluster.provision()
    result = cluster.train("tiny", on_event=print)
    print(result.summary.final_loss, result.summary.loss_plot)
    print("\n".join(cluster.plan("qwen-7b").plan))  # the plan only (train.yml --check)

Each call is one ansible-runner run of one playbook (ansible-runner starts ansible-playbook with
the project's ansible.cfg); artifacts go to .runner/artifacts/<ident>/ (the oldest rotated away),
results come from Ansible's events and stats, and failures raise typed exceptions that name the
failing host, task and message. The code lives in llama_runner/ (api, results, errors, events,
status, cli); this file is the entry point and re-exports its API.

CLI: python train_runner.py {lab,provision,check,train,plan,scaling,status,attach,stop,logs,
     export,run} --help
Exit codes: 0 success, 1 a playbook failed, 2 bad input (a validation play, an argument spec or
the command line rejected it), 3 a host was unreachable, 130 interrupted (Ctrl-C or SIGTERM).
"""

import sys

try:
    from llama_runner import *  # noqa: F403 - this module is the package's public face
    from llama_runner import __all__  # noqa: F401 - star-imports of train_runner re-export the same
except ImportError as error:  # outside a checkout (llama_runner.checkout.NotACheckout)
    if error.name != "llama_runner":
        raise
    OUTSIDE: ImportError | None = error
else:
    OUTSIDE = None


def main() -> int:
    """The command line (llama_runner.cli, the `llama-cluster` command); outside a checkout,
    one line that says where to run it (exit status 2)."""
    if OUTSIDE is not None:
        sys.stderr.write(f"llama-cluster: {OUTSIDE}\n")
        return 2
    from llama_runner.cli import main as cli  # noqa: PLC0415 - the CLI's own imports (rich)

    return cli()


if __name__ == "__main__":
    sys.exit(main())
