"""llama-job, the node-side supervisor of llama-cluster's distributed jobs, as a package.

Shipped to the nodes as one zipapp (build.py); protocol.py is also what the controller's
module, filters and llama_runner import for phases, status and outcome.
"""
