"""The simulator's state of one request between its arrival and its end."""

from __future__ import annotations

from dataclasses import dataclass

from app.routing.view import RouteRequest
from app.sim.instance import SimInstance
from app.sim.records import RequestRecord
from app.workloads.workload import WorkloadRequest


@dataclass(slots=True, eq=False)
class SimFlight:
    """Simulator-side state of one request between arrival and its end."""

    index: int  # in the workload
    work: WorkloadRequest
    route: RouteRequest
    record: RequestRecord
    token_seed: int
    instance: SimInstance | None = None  # engine holding it now (None: queued / in transfer)
    decode_target: SimInstance | None = None  # disaggregated: chosen at arrival
