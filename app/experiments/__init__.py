"""Experiments the `goodserve` CLI runs: trace replay (simulated or live), the faults
harness, routing overhead and autoscaling, on the same routing code as serving."""
