"""Experiments the `goodserve` CLI runs: trace replay (simulated or live), the live demo,
the faults harness, routing overhead and autoscaling, on the same routing code as
serving; `knob_cli` gives their commands one option per routing knob."""
