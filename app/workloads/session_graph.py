"""The dependencies between a workload's requests: which steps of an agent session
each one waits for, the tool wait after them, and the earliest each may be issued.

A `Workload` with a graph is closed-loop; the sessions that draw the graph and the
release logic that follows it are in `app.workloads.sessions`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SessionGraph:
    """Dependencies between the requests of a workload, by request index."""

    parents: tuple[tuple[int, ...], ...]  # index -> indices it waits for
    tool_wait_s: tuple[float, ...]  # index -> wait after its last parent ends
    # index -> the earliest it may be issued (its own arrival); None: as soon as ready
    earliest_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.tool_wait_s):
            raise ValueError("one tool wait per request")
        if self.earliest_s is not None and len(self.earliest_s) != len(self.parents):
            raise ValueError("one earliest issue time per request")

    def release_s(self, index: int, ready_s: float) -> float:
        """When request `index` is issued once it is ready at `ready_s`."""
        return ready_s if self.earliest_s is None else max(ready_s, self.earliest_s[index])

    def issue_after_s(self, index: int, last_parent_end_s: float) -> float:
        """When step `index` is issued after its last parent ended at
        `last_parent_end_s`: its tool wait later, and not before its own arrival."""
        return self.release_s(index, last_parent_end_s + self.tool_wait_s[index])

    @property
    def roots(self) -> list[int]:
        return [i for i, p in enumerate(self.parents) if not p]

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.parents]
        for child, parents in enumerate(self.parents):
            for parent in parents:
                out[parent].append(child)
        return out
