"""The P->D KV transfer link as a FIFO server: the simulator's link, and the router's
model of the real one (what it expects a transfer it is about to cause to take)."""

from __future__ import annotations


class KvLink:
    """P->D KV transfer link: one FIFO server, service = bytes / bandwidth.

    With FIFO order and known service times a transfer's completion time is known
    on enqueue, so the link needs no events of its own.
    """

    def __init__(self, bandwidth_gbps: float) -> None:
        if bandwidth_gbps <= 0:
            raise ValueError(f"KV link bandwidth must be > 0 GB/s, got {bandwidth_gbps}")
        self.bytes_per_s = bandwidth_gbps * 1e9
        self.busy_until_s = 0.0
        self.busy_s = 0.0
        self.num_transfers = 0

    def enqueue(self, now: float, num_bytes: float) -> float:
        """Queue a transfer; returns when its last byte arrives."""
        service_s = num_bytes / self.bytes_per_s
        self.busy_until_s = max(now, self.busy_until_s) + service_s
        self.busy_s += service_s
        self.num_transfers += 1
        return self.busy_until_s

    def expected_done_s(self, start_s: float, num_bytes: float) -> float:
        """When a transfer of `num_bytes` queued at `start_s` would arrive (changes nothing)."""
        return max(start_s, self.busy_until_s) + num_bytes / self.bytes_per_s
