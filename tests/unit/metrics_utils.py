"""An in-memory `MetricFactory` for tests: what each instrument was given."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence


class Recorded:
    """One instrument's values by tag set: counters add, gauges keep the last value,
    histograms keep every observation."""

    def __init__(self, kind: str, tag_keys: tuple[str, ...]) -> None:
        self.kind, self.tag_keys = kind, tag_keys
        self.values: dict[tuple, list[float]] = defaultdict(list)

    def _key(self, tags: Mapping[str, str] | None) -> tuple:
        tags = dict(tags or {})
        assert set(tags) == set(self.tag_keys), (tags, self.tag_keys)  # Ray requires it too
        return tuple(sorted(tags.items()))

    def inc(self, value: float = 1.0, tags: Mapping[str, str] | None = None) -> None:
        # as Ray's counter, which raises on a step that is not > 0
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0
        slot = self.values[self._key(tags)]
        slot[:] = [(slot[0] if slot else 0.0) + value]

    def set(self, value: float, tags: Mapping[str, str] | None = None) -> None:
        assert isinstance(value, int | float) and math.isfinite(value)
        self.values[self._key(tags)][:] = [value]

    def observe(self, value: float, tags: Mapping[str, str] | None = None) -> None:
        assert isinstance(value, int | float) and math.isfinite(value)
        self.values[self._key(tags)].append(value)

    def get(self, **tags: str) -> list[float]:
        return self.values.get(tuple(sorted(tags.items())), [])


class RecordingFactory:
    def __init__(self) -> None:
        self.instruments: dict[str, Recorded] = {}

    def _make(self, name: str, kind: str, tag_keys: tuple[str, ...]) -> Recorded:
        assert name.startswith("goodserve_") and name not in self.instruments
        self.instruments[name] = Recorded(kind, tag_keys)
        return self.instruments[name]

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Recorded:
        assert description
        return self._make(name, "counter", tag_keys)

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Recorded:
        assert description
        return self._make(name, "gauge", tag_keys)

    def histogram(self, name: str, description: str, boundaries: Sequence[float],
                  tag_keys: tuple[str, ...]) -> Recorded:
        assert description and all(b > 0 for b in boundaries)  # Ray's rule
        assert list(boundaries) == sorted(boundaries)
        return self._make(name, "histogram", tag_keys)

    def __getitem__(self, name: str) -> Recorded:
        return self.instruments[name]
