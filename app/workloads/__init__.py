"""What the cluster is asked to serve: requests and when they arrive (`workload`), agent
sessions whose steps wait on each other (`sessions`, `session_graph`) and the deadline
each request gets (`slo`). Submodules are imported directly."""
