"""Ray's metrics API behind `app.serving.telemetry.MetricFactory`: the series appear on each
node's Ray metrics endpoint (`ray start --metrics-export-port`, or `goodserve serve
--metrics-export-port`) beside Ray's own, every name prefixed `ray_` by Ray."""

from __future__ import annotations

from collections.abc import Sequence

from ray.util import metrics


class RayMetricFactory:
    """Makes `ray.util.metrics` instruments (in any Ray worker or driver)."""

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> metrics.Counter:
        return metrics.Counter(name, description, tag_keys=tag_keys)

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> metrics.Gauge:
        return metrics.Gauge(name, description, tag_keys=tag_keys)

    def histogram(self, name: str, description: str, boundaries: Sequence[float],
                  tag_keys: tuple[str, ...]) -> metrics.Histogram:
        return metrics.Histogram(name, description, boundaries=list(boundaries),
                                 tag_keys=tag_keys)
