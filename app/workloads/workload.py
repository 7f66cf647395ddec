"""Workloads: trace loaders, arrival processes and request content.

A workload is two independent choices zipped together: *when* requests arrive
(a time-scaled, windowed trace, or a synthetic process: Poisson, a bursty Gamma
renewal process, or batches of simultaneous arrivals) and *what* they are (the trace's own
lengths and prefix blocks, or real prompts with real output lengths). Loaders read
each row through a strict pydantic schema (a token count is an integer, not "12" nor
12.0) and fail with one error form, `file:line: field 'name': what is wrong`.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Annotated, Any, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from app.engines.prefix import prefix_block_hashes
from app.routing.view import RouteRequest
from app.workloads.session_graph import SessionGraph
from predictor.jsonl import iter_jsonl_objects

MOONCAKE_BLOCK_TOKENS = 512  # tokens per Mooncake hash_id
TEXT_BYTES_PER_BLOCK = 64  # ~16 Llama-3 tokens of English text

Row = TypeVar("Row")


def _integer_as_text(value: object) -> object:
    """An id written as an integer, as its text; anything else as given."""
    return str(value) if type(value) is int else value


Identifier = Annotated[StrictStr, BeforeValidator(_integer_as_text)]  # a string or an integer
Count = Annotated[StrictInt, Field(ge=1)]  # a token count: an integer, not "12" nor 12.0


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to replay; `slo_s` stays inf until an SLO is assigned."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int  # ground truth (what the engine will generate)
    block_hashes: tuple[int, ...] = ()
    hash_block_size: int = 16
    prompt: str | None = None
    task: str | None = None
    slo_s: float = math.inf
    predicted_output_tokens: int | None = None
    session_id: str | None = None  # agent sessions: the session this step belongs to
    step_index: int = 0
    num_appended_tokens: int | None = None  # new tokens beyond the context it extends
    ttft_slo_s: float | None = None  # the SLO's TTFT and TPOT parts (assigned with slo_s)
    tpot_slo_s: float | None = None

    @property
    def deadline_s(self) -> float:
        return self.arrival_s + self.slo_s

    def route_request(self, reveal_true_length: bool = False) -> RouteRequest:
        """What a routing policy sees of this request (exact-length policies: its length too)."""
        return RouteRequest(
            request_id=self.request_id,
            arrival_s=self.arrival_s,
            deadline_s=self.deadline_s,
            num_prompt_tokens=self.num_prompt_tokens,
            block_hashes=self.block_hashes,
            hash_block_size=self.hash_block_size,
            prompt=self.prompt,
            task=self.task,
            session_id=self.session_id,
            step_index=self.step_index,
            num_appended_tokens=self.num_appended_tokens,
            ttft_slo_s=self.ttft_slo_s,
            tpot_slo_s=self.tpot_slo_s,
            predicted_output_tokens=self.predicted_output_tokens,
            true_output_tokens=self.num_output_tokens if reveal_true_length else None,
        )


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival, plus the length of the arrival window.

    `duration_s` is the denominator of goodput: the requested window when one was
    given (Poisson, windowed trace), otherwise last minus first arrival. With a
    `graph` (agent sessions) the workload is closed-loop: a request is issued when the
    ones it waits for have finished, plus its tool wait (`app.workloads.sessions`).
    """

    requests: tuple[WorkloadRequest, ...]
    duration_s: float
    name: str = "workload"
    graph: SessionGraph | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def with_requests(self, requests: Sequence[WorkloadRequest]) -> Workload:
        return replace(self, requests=tuple(requests))


@dataclass(frozen=True)
class Content:
    """What a request is, independent of when it arrives."""

    num_prompt_tokens: int
    num_output_tokens: int
    block_hashes: tuple[int, ...] = ()
    hash_block_size: int = 16
    prompt: str | None = None
    task: str | None = None


@dataclass(frozen=True)
class TraceRow:
    """One arrival of a production trace with its own lengths."""

    arrival_s: float
    content: Content


@dataclass(frozen=True)
class PromptRow:
    """One row of prompt_lengths.jsonl: a real prompt and a real answer length.

    Also the row's schema (`parse_row`): every field strict, other keys ignored."""

    __pydantic_config__ = ConfigDict(extra="ignore")

    prompt_id: Identifier
    source: StrictStr
    task: StrictStr
    model: StrictStr  # the model that answered
    prompt_tokens: Count
    output_tokens: Count
    prompt: StrictStr

    def content(self) -> Content:
        hashes = text_block_hashes(self.prompt, self.prompt_tokens)
        return Content(
            self.prompt_tokens, self.output_tokens, hashes, 16, self.prompt, self.task
        )


def text_block_hashes(text: str, num_tokens: int, block_size: int = 16) -> tuple[int, ...]:
    """Approximate prefix hashes of a prompt we have as text, not token ids.

    Fixed 64-byte chunks stand in for 16-token blocks, so prompts sharing a prefix
    share leading hashes, as they would in vLLM.
    """
    data = text.encode()
    hashes = prefix_block_hashes(data, TEXT_BYTES_PER_BLOCK)
    return hashes[: num_tokens // block_size]


# ---- file parsing ---------------------------------------------------------------


def row_error(where: str, field: str, message: str) -> ValueError:
    """The one error every loader raises for a bad row: `file:line: field 'name': ...`."""
    return ValueError(f"{where}: field {field!r}: {message}")


@cache
def _adapter(schema: type[Row]) -> TypeAdapter[Row]:
    return TypeAdapter(schema)


def parse_row(schema: type[Row], row: dict[str, Any], where: str) -> Row:
    """`row` validated as `schema`; its first error as a `row_error`."""
    try:
        return _adapter(schema).validate_python(row)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise row_error(where, str(first["loc"][0]), first["msg"]) from None


def jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file:line, object) for every non-blank line of an existing JSON-lines file."""
    if not path.is_file():
        raise ValueError(f"file not found: {path}")
    for where, _, row in iter_jsonl_objects(path):
        yield where, row


class MooncakeLine(BaseModel):
    """One line of a Mooncake trace; other keys are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    timestamp: float = Field(ge=0, allow_inf_nan=False)  # ms from the trace's start
    input_length: Count
    output_length: Count
    hash_ids: list[int] = []  # one id per 512-token block; equal ids, shared prefix

    def trace_row(self) -> TraceRow:
        content = Content(self.input_length, self.output_length, tuple(self.hash_ids),
                          MOONCAKE_BLOCK_TOKENS)
        return TraceRow(self.timestamp / 1000.0, content)


def load_mooncake(path: str | Path) -> list[TraceRow]:
    """Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids (512-token)."""
    path = Path(path)
    rows = [parse_row(MooncakeLine, row, where).trace_row() for where, row in jsonl_rows(path)]
    return _nonempty(rows, path)


def _decimal_text_as_integer(value: object) -> object:
    """A CSV cell holding a plain decimal integer, as that integer; anything else as
    given, for the strict check to reject ("12.0" is not a count)."""
    if isinstance(value, str) and (text := value.strip()).isascii() and text.isdecimal():
        return int(text)
    return value


def _text_as_seconds(value: object) -> object:
    """Azure timestamps are datetimes; plain numbers are taken as seconds."""
    if not isinstance(value, str):
        return value
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value.strip()).timestamp()
    except ValueError:
        raise PydanticCustomError(
            "timestamp", "Input should be a datetime or a number of seconds") from None


CsvCount = Annotated[StrictInt, BeforeValidator(_decimal_text_as_integer), Field(ge=1)]


class AzureLine(BaseModel):
    """One row of an Azure LLM inference trace (CSV: every cell is text); other columns
    are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    arrival_s: Annotated[float, BeforeValidator(_text_as_seconds)] = Field(
        alias="TIMESTAMP", allow_inf_nan=False)
    num_prompt_tokens: CsvCount = Field(alias="ContextTokens")
    num_output_tokens: CsvCount = Field(alias="GeneratedTokens")


def load_azure(path: str | Path) -> list[TraceRow]:
    """Azure LLM inference CSV: TIMESTAMP, ContextTokens, GeneratedTokens (no prefix info)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"file not found: {path}") from None
    reader = csv.DictReader(text.splitlines())
    rows = []
    for row in reader:
        line = parse_row(AzureLine, row, f"{path}:{reader.line_num}")
        rows.append(TraceRow(line.arrival_s,
                             Content(line.num_prompt_tokens, line.num_output_tokens)))
    rows.sort(key=lambda r: r.arrival_s)
    start = rows[0].arrival_s if rows else 0.0
    rows = [replace(r, arrival_s=r.arrival_s - start) for r in rows]
    return _nonempty(rows, path)


def load_trace(path: str | Path) -> list[TraceRow]:
    """Dispatch on the extension: .jsonl -> Mooncake, .csv -> Azure."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return load_mooncake(path)
    if suffix == ".csv":
        return load_azure(path)
    raise ValueError(f"{path}: unknown trace format (expected .jsonl Mooncake or .csv Azure)")


def load_prompts(path: str | Path) -> list[PromptRow]:
    """prompt_lengths.jsonl rows (real prompt text + real output token counts). A row
    without `prompt_id` is named by its file and line; `source`, `task` and `model`
    default to empty."""
    path = Path(path)
    rows = [parse_row(PromptRow, {"prompt_id": where, "source": "", "task": "", "model": ""}
                      | row, where)
            for where, row in jsonl_rows(path)]
    return _nonempty(rows, path)


def _nonempty(rows: list, path: Path) -> list:
    if not rows:
        raise ValueError(f"{path}: no requests in file")
    return rows


# ---- arrivals -------------------------------------------------------------------


def native_rate(rows: Sequence[TraceRow]) -> float:
    """Mean arrival rate of a trace (arrivals per second over its span)."""
    return native_rate_of([r.arrival_s for r in rows])


def scale_and_window(
    rows: Sequence[TraceRow],
    *,
    rate: float | None = None,
    duration_s: float | None = None,
    max_requests: int | None = None,
) -> tuple[list[TraceRow], float]:
    """Stretch the trace to `rate` req/s, then keep its first `duration_s` seconds.

    Returns the rows (re-based to start at 0) and the window length for goodput.
    """
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if duration_s is not None and duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    factor = 1.0 if rate is None else native_rate(rows) / rate
    start = rows[0].arrival_s
    scaled = [replace(r, arrival_s=(r.arrival_s - start) * factor) for r in rows]
    if duration_s is not None:
        scaled = [r for r in scaled if r.arrival_s < duration_s]
    if max_requests is not None:
        scaled = scaled[:max_requests]
    if not scaled:
        raise ValueError("the window selects no requests")
    window = duration_s if duration_s is not None and max_requests is None else None
    return scaled, window if window is not None else scaled[-1].arrival_s


def spread_within_ticks(workload: Workload, seed: int) -> Workload:
    """The requests that share an arrival time, spread uniformly up to the next distinct
    one (the last tick spans the mean gap): a trace whose timestamps were rounded (the
    Mooncake conversation trace's ticks hold about ten requests each) replayed as the
    spread arrivals the ticks stood for, instead of bursts at one instant."""
    if workload.graph is not None:
        raise ValueError("a closed-loop workload issues its steps itself: no ticks to spread")
    times = sorted({r.arrival_s for r in workload.requests})
    if len(times) < 2:
        return workload
    mean_gap_s = (times[-1] - times[0]) / (len(times) - 1)
    next_tick = dict(zip(times, [*times[1:], times[-1] + mean_gap_s], strict=True))
    rng = random.Random(seed)
    spread = [replace(r, arrival_s=rng.uniform(r.arrival_s, next_tick[r.arrival_s]))
              for r in workload.requests]
    return workload.with_requests(sorted(spread, key=lambda r: r.arrival_s))


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process on [0, duration_s)."""
    _check_rate(rate, duration_s, "Poisson")
    rng = random.Random(seed)
    times, t = [], rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def gamma_arrivals(rate: float, duration_s: float, cv: float, seed: int) -> list[float]:
    """Arrival times of a Gamma renewal process on [0, duration_s): i.i.d. gaps with mean
    1/rate and coefficient of variation `cv` (1 = Poisson; above 1, bursts of nearly
    simultaneous arrivals separated by long lulls)."""
    _check_rate(rate, duration_s, "Gamma")
    if cv <= 0:
        raise ValueError(f"burstiness (coefficient of variation) must be > 0, got {cv}")
    shape = 1.0 / cv**2
    rng = np.random.default_rng(seed)
    chunk = max(int(rate * duration_s * 1.2), 16)
    times: list[float] = []
    t = 0.0
    while True:
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=chunk)
        stamps = t + np.cumsum(gaps)
        inside = stamps[stamps < duration_s]
        times.extend(inside.tolist())
        if len(inside) < chunk:
            return times
        t = float(stamps[-1])


class BurstDistribution(StrEnum):
    """How many requests arrive together in a batch arrival process."""

    FIXED = "fixed"  # always the mean (rounded)
    GEOMETRIC = "geometric"  # 1, 2, ... with P(n) = p (1-p)^(n-1), mean 1/p
    UNIFORM = "uniform"  # uniform on 1 .. 2 mean - 1


def burst_sizes(distribution: BurstDistribution, mean: float, n: int,
                rng: np.random.Generator) -> np.ndarray:
    """`n` burst sizes (each >= 1) with the given mean."""
    if mean < 1:
        raise ValueError(f"mean burst size must be >= 1, got {mean}")
    if distribution == BurstDistribution.FIXED:
        return np.full(n, max(round(mean), 1))
    if distribution == BurstDistribution.GEOMETRIC:
        return rng.geometric(1.0 / mean, size=n)
    return rng.integers(1, max(round(2 * mean - 1), 1) + 1, size=n)


def batch_arrivals(
    rate: float, duration_s: float, mean_burst: float, distribution: BurstDistribution,
    seed: int,
) -> list[float]:
    """Arrival times on [0, duration_s) in bursts of simultaneous requests (an agent
    fanning out tool calls): burst epochs are Poisson at rate / `mean_burst`, each burst
    brings a size drawn from `distribution`, so the request rate is `rate` on average."""
    _check_rate(rate, duration_s, "batch")
    rng = np.random.default_rng(seed)
    epochs = poisson_arrivals(rate / mean_burst, duration_s, seed)
    sizes = burst_sizes(distribution, mean_burst, len(epochs), rng)
    return [t for t, size in zip(epochs, sizes, strict=True) for _ in range(int(size))]


def _check_rate(rate: float, duration_s: float, process: str) -> None:
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"{process} arrivals need rate and duration > 0, got {rate}, {duration_s}")


class ContentMode(StrEnum):
    """What the requests are, the other half of a workload."""

    TRACE = "trace"  # the trace's own input/output lengths and prefix blocks
    PROMPTS = "prompts"  # real prompts with real output lengths (prompt_lengths.jsonl)
    CODING_AGENT = "coding-agent"  # closed-loop agent sessions, TraceLab-like
    CHAT_AGENT = "chat-agent"  # closed-loop agent sessions, Mooncake-like
    RESEARCH_AGENT = "research-agent"  # closed-loop sessions of parallel sub-agents
    SESSIONS = "sessions"  # closed-loop agent sessions from a JSONL session log

    @property
    def is_preset(self) -> bool:
        """A session preset (`SessionPreset` has the same values): every mode but a
        trace, prompts or a session log."""
        return self not in (ContentMode.TRACE, ContentMode.PROMPTS, ContentMode.SESSIONS)


class Arrivals(StrEnum):
    TRACE = "trace"  # the trace's timestamps, time-scaled to the rate
    POISSON = "poisson"  # Poisson at the rate for the duration
    GAMMA = "gamma"  # Gamma renewal at the rate, coefficient of variation = burstiness
    BATCH = "batch"  # bursts of simultaneous arrivals, sizes from a distribution


@dataclass(frozen=True)
class SyntheticArrivals:
    """A synthetic arrival process at `rate` req/s for `duration_s` (not the trace's)."""

    kind: Arrivals
    rate: float
    duration_s: float
    burstiness: float = 1.0  # Gamma: coefficient of variation of the gaps
    mean_burst: float = 16.0  # batch: mean requests per burst
    burst_distribution: BurstDistribution = BurstDistribution.GEOMETRIC

    def times(self, seed: int) -> list[float]:
        if self.kind == Arrivals.POISSON:
            return poisson_arrivals(self.rate, self.duration_s, seed)
        if self.kind == Arrivals.GAMMA:
            return gamma_arrivals(self.rate, self.duration_s, self.burstiness, seed)
        if self.kind == Arrivals.BATCH:
            return batch_arrivals(self.rate, self.duration_s, self.mean_burst,
                                  self.burst_distribution, seed)
        raise ValueError(f"{self.kind.value} arrivals are not synthetic")

    @property
    def label(self) -> str:
        if self.kind == Arrivals.GAMMA:
            return f"gamma-cv{self.burstiness:g}"
        if self.kind == Arrivals.BATCH:
            return f"batch-{self.burst_distribution.value}{self.mean_burst:g}"
        return self.kind.value


# ---- assembling -----------------------------------------------------------------


def sample_contents(pool: Sequence[Content], n: int, seed: int) -> list[Content]:
    """n contents drawn from a seeded permutation of the pool, cycled when n > pool."""
    if not pool:
        raise ValueError("no content to sample from")
    rng = random.Random(seed)
    out: list[Content] = []
    while len(out) < n:
        order = list(pool)
        rng.shuffle(order)
        out.extend(order[: n - len(out)])
    return out


def make_workload(
    arrival_s: Sequence[float], contents: Sequence[Content], duration_s: float, name: str
) -> Workload:
    """Zip arrivals with contents into a sorted workload with ids r0, r1, ..."""
    if len(arrival_s) != len(contents):
        raise ValueError(f"{len(arrival_s)} arrivals but {len(contents)} contents")
    pairs = sorted(zip(arrival_s, contents, strict=True), key=lambda p: p[0])
    requests = tuple(
        WorkloadRequest(
            request_id=f"r{i}",
            arrival_s=t,
            num_prompt_tokens=c.num_prompt_tokens,
            num_output_tokens=c.num_output_tokens,
            block_hashes=c.block_hashes,
            hash_block_size=c.hash_block_size,
            prompt=c.prompt,
            task=c.task,
        )
        for i, (t, c) in enumerate(pairs)
    )
    return Workload(requests, duration_s, name)


def trace_workload(
    rows: Sequence[TraceRow],
    *,
    rate: float | None = None,
    duration_s: float | None = None,
    max_requests: int | None = None,
    prompts: Sequence[PromptRow] | None = None,
    seed: int = 0,
    name: str = "trace",
) -> Workload:
    """Trace arrivals; content from the trace itself or from real prompts (seeded pairing)."""
    kept, window = scale_and_window(
        rows, rate=rate, duration_s=duration_s, max_requests=max_requests
    )
    if prompts is None:
        contents = [r.content for r in kept]
    else:
        contents = sample_contents([p.content() for p in prompts], len(kept), seed)
    return make_workload([r.arrival_s for r in kept], contents, window, name)


def synthetic_workload(
    arrivals: SyntheticArrivals, pool: Sequence[Content], *, seed: int = 0,
    name: str | None = None,
) -> Workload:
    """Synthetic arrivals, content sampled from `pool` (seed + 1: the same draws
    whatever the process)."""
    times = arrivals.times(seed)
    if not times:
        raise ValueError(f"no arrivals: rate {arrivals.rate}/s over {arrivals.duration_s} s")
    contents = sample_contents(pool, len(times), seed + 1)
    return make_workload(times, contents, arrivals.duration_s, name or arrivals.label)


def poisson_workload(
    rate: float, duration_s: float, pool: Sequence[Content], *, seed: int = 0, name: str = "poisson"
) -> Workload:
    """Poisson arrivals at `rate` for `duration_s`, content sampled from `pool`."""
    return synthetic_workload(SyntheticArrivals(Arrivals.POISSON, rate, duration_s), pool,
                              seed=seed, name=name)


class LoadShape(StrEnum):
    """Time-varying load for autoscaling experiments."""

    PHASES = "phases"  # low, peak, low: a third of the window each
    RAMP = "ramp"  # low rising linearly to peak over the window
    DIURNAL = "diurnal"  # one smooth day: low at the ends, peak at the middle
    BURSTY = "bursty"  # flat at the phases' mean, arrivals clustered (Gamma gaps, CV >= 4)


DEFAULT_BURST_CV = 4.0  # bursty shape: coefficient of variation of the gaps
PROFILE_GRID_POINTS = 4097


@dataclass(frozen=True)
class RateProfile:
    """Target rate over a window: `shape` between `low_rps` and `peak_rps` (arrivals per
    second: requests, or sessions for closed-loop session content).

    `bursty` keeps the rate flat at the phases' mean, (2 low + peak) / 3, and imposes
    its own native arrival sequence, a Gamma renewal process whose gaps have CV
    `burstiness`; the other shapes warp the source's own sequence (`warp`)."""

    shape: LoadShape
    low_rps: float
    peak_rps: float
    duration_s: float
    burstiness: float = DEFAULT_BURST_CV

    def __post_init__(self) -> None:
        if not 0 < self.low_rps <= self.peak_rps:
            raise ValueError(f"need 0 < low <= peak rate, got {self.low_rps}, {self.peak_rps}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0, got {self.duration_s}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    def rate_at(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=float)
        low, peak, duration = self.low_rps, self.peak_rps, self.duration_s
        if self.shape is LoadShape.RAMP:
            return low + (peak - low) * t / duration
        if self.shape is LoadShape.DIURNAL:
            return low + (peak - low) * (1.0 - np.cos(2.0 * math.pi * t / duration)) / 2.0
        if self.shape is LoadShape.BURSTY:
            return np.full_like(t, (2.0 * low + peak) / 3.0)
        third = duration / 3
        return np.where((t >= third) & (t < 2 * third), peak, low)

    @property
    def mean_rps(self) -> float:
        grid = np.linspace(0.0, self.duration_s, PROFILE_GRID_POINTS)
        return float(np.mean(self.rate_at(grid)))

    def expected_arrivals(self, t: np.ndarray) -> np.ndarray:
        """Cumulative expected arrivals by time t (the rate's integral)."""
        grid = np.linspace(0.0, self.duration_s, PROFILE_GRID_POINTS)
        rates = self.rate_at(grid)
        cumulative = np.concatenate(([0.0], np.cumsum((rates[1:] + rates[:-1]) / 2
                                                      * np.diff(grid))))
        return np.interp(t, grid, cumulative)

    @property
    def expected_total(self) -> float:
        """Arrivals the window expects."""
        return float(self.expected_arrivals(self.duration_s))

    @property
    def imposes_arrivals(self) -> bool:
        """Whether the shape replaces the source's own arrival sequence (bursty)."""
        return self.shape is LoadShape.BURSTY

    def native_process(self) -> SyntheticArrivals:
        """A native arrival sequence in arrival units (rate 1 over `expected_total`) for
        sources without one of their own, or when the shape imposes one: Gamma gaps with
        CV `burstiness` for bursty, else Poisson."""
        kind = Arrivals.GAMMA if self.imposes_arrivals else Arrivals.POISSON
        return SyntheticArrivals(kind, 1.0, self.expected_total, self.burstiness)

    def warp(self, native: np.ndarray) -> np.ndarray:
        """Native positions in arrival units (the n-th arrival near n) to times in the
        window: position x lands at the t with expected_arrivals(t) = x; inf past the
        window's expected total."""
        grid = np.linspace(0.0, self.duration_s, PROFILE_GRID_POINTS)
        return np.interp(np.asarray(native, dtype=float), self.expected_arrivals(grid), grid,
                         right=math.inf)


def shaped_arrivals(profile: RateProfile, seed: int,
                    own_s: Sequence[float] | None = None) -> list[tuple[float, int]]:
    """Arrival times that follow `profile`, each with its position in the source's
    sequence: (time, i), the i-th source arrival (i mod the source's length is the row,
    i div it the pass).

    The i-th arrival keeps its place in the source's own sequence `own_s` (its bursts
    and lulls) and lands where the profile expects it: native time s maps to the t with
    expected_arrivals(t) = s x the source's native rate; the source repeats when the
    profile expects more arrivals than it holds, one mean gap after its last. A source
    without a sequence of its own, or a shape that imposes one (bursty), gets the
    profile's native process (`RateProfile.native_process`, seeded)."""
    if own_s is None or profile.imposes_arrivals:
        native = np.array(profile.native_process().times(seed))
    else:
        start = own_s[0]
        one_pass = (np.array(own_s) - start) * native_rate_of(own_s)
        period = one_pass[-1] + 1.0  # one mean gap between a pass's last and the next's first
        passes = max(1, math.ceil(profile.expected_total / period))
        native = np.concatenate([one_pass + k * period for k in range(passes)])
    times = profile.warp(native)
    kept = [(float(t), i) for i, t in enumerate(times) if t < profile.duration_s]
    if not kept:
        raise ValueError("the profile selects no arrivals")
    return kept


def native_rate_of(times_s: Sequence[float]) -> float:
    """Mean arrival rate of sorted arrival times (arrivals per second over their span)."""
    if len(times_s) < 2 or times_s[-1] - times_s[0] <= 0:
        raise ValueError("rate needs at least two arrivals at different times")
    return (len(times_s) - 1) / (times_s[-1] - times_s[0])


def shaped_trace_workload(
    rows: Sequence[TraceRow], profile: RateProfile, *,
    prompts: Sequence[PromptRow] | None = None, seed: int = 0, name: str = "trace",
) -> Workload:
    """The trace's arrivals time-warped so that the rate follows `profile`
    (`shaped_arrivals`); bursty takes the trace's rows in order, cycled, at the Gamma
    sequence's arrivals."""
    kept = shaped_arrivals(profile, seed, [r.arrival_s for r in rows])
    if prompts is None:
        contents = [rows[i % len(rows)].content for _, i in kept]
    else:
        contents = sample_contents([p.content() for p in prompts], len(kept), seed)
    return make_workload([t for t, _ in kept], contents, profile.duration_s, name)
