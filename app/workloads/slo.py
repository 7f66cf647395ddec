"""End-to-end SLO assignment.

SLO of a request = its solo execution time on a reference instance (A800 by
default) x a relaxation scale; deadline = arrival + SLO. Solo times come from the
same hardware model the simulated engines use, so scale 1 is exactly "as fast as
an idle A800".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from app.hardware.specs import InstanceSpec, make_instance
from app.workloads.workload import Workload, WorkloadRequest

DEFAULT_SLO_SCALES: tuple[float, ...] = (1.0, 1.5, 2.0, 2.5, 3.0)
DEFAULT_REFERENCE_GPU = "A800"


def reference_instance(model: str, gpu: str = DEFAULT_REFERENCE_GPU, tp: int = 1) -> InstanceSpec:
    return make_instance(gpu, model, tp)


def solo_phases_s(
    requests: Sequence[WorkloadRequest], reference: InstanceSpec, chunk_size: int = 8192
) -> list[tuple[float, float]]:
    """(TTFT, mean TPOT) of each request alone on `reference` (memoised per lengths).

    An agent step's context is cached where its session ran, so its solo time counts
    only the appended tokens as prefill (scale 1: an idle A800 holding the session).
    """
    cache: dict[tuple[int, int, int], tuple[float, float]] = {}
    out = []
    for r in requests:
        cached = 0 if r.num_appended_tokens is None else r.num_prompt_tokens - r.num_appended_tokens
        key = (r.num_prompt_tokens, r.num_output_tokens, cached)
        if key not in cache:
            cache[key] = reference.solo_phases_s(key[0], key[1], chunk_size=chunk_size,
                                                 num_cached_tokens=cached)
        out.append(cache[key])
    return out


def solo_latencies_s(
    requests: Sequence[WorkloadRequest], reference: InstanceSpec, chunk_size: int = 8192
) -> list[float]:
    """Solo execution time of each request on `reference` (`solo_phases_s` summed)."""
    return phases_total_s(requests, solo_phases_s(requests, reference, chunk_size))


def phases_total_s(requests: Sequence[WorkloadRequest],
                   phases_s: Sequence[tuple[float, float]]) -> list[float]:
    """End-to-end solo times from (TTFT, TPOT) pairs."""
    return [ttft + max(r.num_output_tokens - 1, 0) * tpot
            for r, (ttft, tpot) in zip(requests, phases_s, strict=True)]


def assign_slos(workload: Workload, solo_s: Sequence[float], scale: float,
                phases_s: Sequence[tuple[float, float]] | None = None) -> Workload:
    """Set each request's SLO to scale x its solo time; with `phases_s` (solo TTFT and
    TPOT), its TTFT and TPOT targets too, at the same scale (what a user of a
    TTFT/TPOT-routed system such as llm-d would set)."""
    if scale <= 0:
        raise ValueError(f"SLO scale must be > 0, got {scale}")
    if len(solo_s) != len(workload):
        raise ValueError(f"{len(solo_s)} solo times for {len(workload)} requests")
    if phases_s is None:
        return workload.with_requests(
            [replace(r, slo_s=scale * s) for r, s in zip(workload.requests, solo_s, strict=True)])
    return workload.with_requests([
        replace(r, slo_s=scale * s, ttft_slo_s=scale * p[0], tpot_slo_s=scale * p[1])
        for r, s, p in zip(workload.requests, solo_s, phases_s, strict=True)])


def parse_scales(text: str) -> tuple[float, ...]:
    """'1,1.5,2' -> (1.0, 1.5, 2.0); ValueError with the bad item otherwise."""
    scales = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"bad SLO scale {item.strip()!r} in {text!r}") from None
        if not value > 0:
            raise ValueError(f"SLO scales must be > 0, got {item.strip()!r}")
        scales.append(value)
    return tuple(scales)
