"""llm-d predicted-latency routing, with its latency-predictor sidecar run in-process.

This follows llm-d-inference-scheduler's default profile when the latency predictor is
enabled (`config/charts/epplib/templates/_config.yaml`):

    predicted-latency-producer -> prefix-cache-affinity-filter (0.99)
    -> slo-headroom-tier-filter -> prefix-cache-affinity-filter (0.80)
    -> latency-scorer ("least" headroom) -> weighted-random-picker

The producer predicts each endpoint's TTFT and TPOT from what the endpoint reports:
KV usage, queue, running requests, the prompt's length, its prefix-cache score and the
prefill tokens in flight. The GPU type is not an input; a slow GPU shows up only through
its load. The producer then subtracts each prediction from the request's SLO (llm-d's
x-slo-ttft-ms / x-slo-tpot-ms headers) to get the endpoint's headroom. With no SLO the
headroom is minus the prediction, so the scorer prefers the lowest predicted latency.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from app.routing.base import RouteDecision
from app.routing.baselines import SeededPolicy, no_fit
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.view import ClusterView, FinishReport, RouteRequest

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from sklearn.ensemble import HistGradientBoostingRegressor
    from threadpoolctl import ThreadpoolController

SCORE_RESOLUTION = 100  # latency-scorer's wMax: scores are multiples of 1/100
HEADROOM_RANGE_EPS_S = 1e-12  # the scorer's eps (1e-9 ms): a smaller range counts as zero


@dataclass(frozen=True)
class PredictedLatencyConfig:
    """llm-d's defaults, plugin by plugin."""

    # prefix-cache-affinity-filter: strict gate before the tier filter, loose one after it
    strict_affinity_threshold: float = 0.99
    loose_affinity_threshold: float = 0.80
    affinity_exploration_probability: float = 0.01  # skip the gate this often
    max_ttft_penalty_s: float = 5.0  # break stickiness when sticky TTFT is this much worse
    # slo-headroom-tier-filter: keep the tier predicted to miss this often (recovery probes)
    epsilon_explore_negative: float = 0.01
    # latency-scorer
    ttft_weight: float = 0.8
    tpot_weight: float = 0.2
    prefer_least_headroom: bool = True  # "least": pack onto the endpoint closest to its SLO
    composite_kv_weight: float = 1.0  # fallback scoring while there are no predictions
    composite_queue_weight: float = 1.0
    composite_prefix_weight: float = 1.0
    # predicted-latency-producer
    slo_buffer_factor: float = 1.0
    # latency-predictor sidecar (training server)
    quantile: float = 0.9  # LATENCY_QUANTILE_ALPHA: models predict the p90
    min_samples_to_fit: int = 10  # LATENCY_MIN_SAMPLES_FOR_RETRAIN_FRESH
    model_sync_interval_s: float = 10.0  # MODEL_SYNC_INTERVAL_SEC (retrained every 1 s)
    max_samples_per_bucket: int = 500  # LATENCY_MAX_TRAINING_DATA_SIZE_PER_BUCKET


@dataclass(frozen=True)
class LatencyFeatures:
    """What the predictor sees of one endpoint for one request."""

    kv_cache_percentage: float  # used / total KV blocks, in [0, 1]
    input_token_length: int
    num_request_waiting: int
    num_request_running: int
    prefill_tokens_in_flight: int  # prompt tokens this router sent there, not yet finished
    prefix_cache_score: float  # cached / prompt tokens, in [0, 1]

    @property
    def prefix_bucket(self) -> int:
        return min(int(min(max(self.prefix_cache_score, 0.0), 1.0) * 4), 3)

    def ttft_row(self) -> tuple[float, ...]:
        """The sidecar's TTFT features, in its order (less pod type and encoder sizes)."""
        effective_input = (1 - self.prefix_cache_score) * self.input_token_length
        return (*self.tpot_row(), self.prefix_cache_score, effective_input, self.prefix_bucket)

    def tpot_row(self) -> tuple[float, ...]:
        """The sidecar's TPOT features. num_tokens_generated is left out because the
        sidecar zeroes it (LATENCY_TPOT_ZERO_TOKEN_COUNT); decode_tokens_in_flight is left
        out because the scheduler always sends 0."""
        return (float(self.num_request_waiting > 0), self.kv_cache_percentage,
                self.input_token_length, self.num_request_waiting, self.num_request_running,
                self.prefill_tokens_in_flight)

    def bucket_key(self, prefix_cache_score: float) -> tuple[int, int, int]:
        """The sidecar's stratification: (queue, KV usage, prefix score) buckets."""
        waiting = self.num_request_waiting
        queue = 0 if waiting == 0 else 1 if waiting <= 2 else 2 if waiting <= 5 else (
            3 if waiting <= 10 else 4)
        kv = min(int(min(max(self.kv_cache_percentage, 0.0), 1.0) * 20), 19)
        return queue, kv, min(int(min(max(prefix_cache_score, 0.0), 1.0) * 4), 3)


Sample = tuple[tuple[float, ...], float]  # (feature row, latency in seconds)
Samples = dict[tuple[int, int, int], deque[Sample]]  # bucket key -> its newest samples


def _all(samples: Samples) -> list[Sample]:
    """Every bucket's samples: the sidecar's training set (`_all_samples`)."""
    return [sample for bucket in samples.values() for sample in bucket]


class OnlineLatencyModel:
    """TTFT and TPOT regressors trained online. This stands in for llm-d's
    latency-predictor sidecar.

    The sidecar keeps samples in buckets of up to 500 each, keyed by (queue, KV,
    prefix score). It fits XGBoost on them: histogram trees of depth 6, 200 rounds,
    learning rate 0.05, quantile loss at p90. Here scikit-learn's
    HistGradientBoostingRegressor takes XGBoost's place. It is the same histogram
    gradient boosting with the same depth, rounds, rate and p90 loss. It has no row
    or column subsampling and a fixed seed, so it is deterministic.

    The training server retrains every LATENCY_RETRAINING_INTERVAL_SEC (1 s in
    llm-d/llm-d-latency-predictor, `deploy/base/training/configmap.yaml`) on every
    sample it holds once it holds 10 (`training/training_server.py`,
    `continuous_training_loop` and `train`), and the prediction servers that answer
    the scheduler fetch its latest model every MODEL_SYNC_INTERVAL_SEC (10 s,
    `deploy/base/prediction/configmap.yaml`). So the model in use changes at each
    fetch, fitted on the samples received before it. Each fit starts from scratch:
    the models are trees, so there are no sufficient statistics to update, and the
    sidecar's only window is its buckets (the newest 500 samples of each of the 400
    (queue, KV, prefix) buckets; no global recent window), which bounds a fit.

    Here the fetches tick at the multiples of `model_sync_interval_s` of the caller's
    clock. The first `add` or `predict` after a tick sets aside the samples received
    before it (when any came since the last fetch), and the first `predict` that
    needs that fetch's model fits it: one fit per fetch that serves a prediction (a
    fit of the two models takes about a second of CPU here), none for a fetch no
    prediction reads before the next, nor for one with no new sample (the sidecar's
    fit on the same samples would be the same model). Not modelled: the scheduler
    sends its samples in batches every second (`FlushInterval`). Until the TPOT model
    exists, TPOT is predicted as 0, i.e. never the reason to avoid an endpoint.

    Fits and predictions run on one OpenMP thread. The data is small, and simulator
    cells running side by side would otherwise oversubscribe the cores; on a busy
    2-core machine that made a fit tens of times slower.
    """

    def __init__(self, quantile: float = 0.9, min_samples_to_fit: int = 10,
                 model_sync_interval_s: float = 10.0, max_samples_per_bucket: int = 500,
                 random_state: int = 42) -> None:
        self.quantile = quantile
        self.min_samples_to_fit = min_samples_to_fit
        if not model_sync_interval_s > 0:
            raise ValueError(f"model sync interval must be > 0 s, got {model_sync_interval_s}")
        self.model_sync_interval_s = model_sync_interval_s
        self.max_samples_per_bucket = max_samples_per_bucket
        self.random_state = random_state
        self.ttft_model_: HistGradientBoostingRegressor | None = None
        self.tpot_model_: HistGradientBoostingRegressor | None = None
        self._ttft_samples: Samples = {}
        self._tpot_samples: Samples = {}
        self._num_since_fetch = 0  # samples received since the last fetch's were set aside
        self._last_tick = -math.inf  # index of the latest model fetch handled
        # the latest fetch's (TTFT, TPOT) training sets, until a prediction fits them
        self._unfitted: tuple[list[Sample], list[Sample]] | None = None
        self._threads: ThreadpoolController | None = None

    def add(self, features: LatencyFeatures, ttft_s: float | None, tpot_s: float | None,
            now: float) -> None:
        """Learn from one request's latency (features as at its dispatch), received at
        `now`: after the fit of any fetch that came before it."""
        self._fetch_if_due(now)
        if ttft_s is not None and ttft_s > 0:
            self._store(self._ttft_samples, features.bucket_key(features.prefix_cache_score),
                        features.ttft_row(), ttft_s)
        if tpot_s is not None and tpot_s > 0:  # TPOT entries carry a prefix score of 0
            self._store(self._tpot_samples, features.bucket_key(0.0), features.tpot_row(), tpot_s)

    def _fetch_if_due(self, now: float) -> None:
        """A fetch ticked since the last call: set its training sets aside (unless no
        sample came since the last fetch: the same model)."""
        tick = math.floor(now / self.model_sync_interval_s)
        if tick <= self._last_tick:
            return
        self._last_tick = tick
        if self._num_since_fetch:
            self._unfitted = (_all(self._ttft_samples), _all(self._tpot_samples))
            self._num_since_fetch = 0

    def _store(self, samples: Samples, key: tuple[int, int, int], row: tuple[float, ...],
               target_s: float) -> None:
        samples.setdefault(key, deque(maxlen=self.max_samples_per_bucket)).append((row, target_s))
        self._num_since_fetch += 1

    def _fit_fetched(self) -> None:
        """Fit the models of the latest fetch; a model with too few samples stays."""
        if self._unfitted is None:
            return
        ttft_rows, tpot_rows = self._unfitted
        self._unfitted = None
        for name, rows in (("ttft_model_", ttft_rows), ("tpot_model_", tpot_rows)):
            model = self._fit(rows)
            if model is not None:
                setattr(self, name, model)

    def _fit(self, rows: list[Sample]) -> HistGradientBoostingRegressor | None:
        if len(rows) < self.min_samples_to_fit:
            return None
        from sklearn.ensemble import HistGradientBoostingRegressor

        model = HistGradientBoostingRegressor(
            loss="quantile", quantile=self.quantile, max_iter=200, max_depth=6,
            max_leaf_nodes=None, learning_rate=0.05, min_samples_leaf=5,
            l2_regularization=0.1, early_stopping=False, random_state=self.random_state,
        )
        with self._one_thread():
            return model.fit(np.array([r for r, _ in rows]), np.array([t for _, t in rows]))

    def predict(self, features: Sequence[LatencyFeatures],
                now: float) -> tuple[np.ndarray, np.ndarray] | None:
        """Predicted (TTFT, TPOT) seconds per feature row by the model in use at `now`;
        None until a TTFT model exists."""
        self._fetch_if_due(now)
        self._fit_fetched()
        if self.ttft_model_ is None:
            return None
        with self._one_thread():
            ttft = self.ttft_model_.predict(np.array([f.ttft_row() for f in features]))
            if self.tpot_model_ is None:
                return ttft, np.zeros(len(features))
            return ttft, self.tpot_model_.predict(np.array([f.tpot_row() for f in features]))

    def _one_thread(self) -> AbstractContextManager:
        if self._threads is None:
            from threadpoolctl import ThreadpoolController

            self._threads = ThreadpoolController()
        return self._threads.limit(limits=1, user_api="openmp")


@dataclass(frozen=True)
class Endpoint:
    """One candidate as the filters and the scorer see it."""

    inst: InstanceView
    features: LatencyFeatures
    ttft_s: float | None  # predicted; None while the model is cold
    tpot_s: float | None
    ttft_headroom_s: float  # SLO - predicted; negative when predicted to miss
    tpot_headroom_s: float
    num_dispatched: int  # requests this router sent there that have not finished

    @property
    def meets_slo(self) -> bool:
        return self.ttft_headroom_s >= 0 and self.tpot_headroom_s >= 0


def headroom_scores(headrooms_s: Sequence[tuple[float, float]], ttft_weight: float,
                    tpot_weight: float, prefer_least: bool) -> list[float]:
    """latency-scorer's `scoreBucket` for (TTFT, TPOT) headrooms in one bucket.

    Each |headroom| is min-max normalized within the bucket (0.5 when the range is
    zero) and the two are blended by the weights. A dimension with zero range gives
    its whole weight to the other. "least" scores 1 - blend and "most" scores the
    blend itself, each truncated to a multiple of 1/100 plus 1/100.
    """
    total = ttft_weight + tpot_weight
    alpha, beta = (ttft_weight / total, tpot_weight / total) if total > 0 else (1.0, 0.0)
    columns = [[abs(h[k]) for h in headrooms_s] for k in (0, 1)]
    lows = [min(c) for c in columns]
    ranges = [max(c) - low for c, low in zip(columns, lows, strict=True)]
    flat = [r <= HEADROOM_RANGE_EPS_S for r in ranges]
    if flat[0] and not flat[1]:
        alpha, beta = 0.0, 1.0
    elif flat[1] and not flat[0]:
        alpha, beta = 1.0, 0.0
    scores = []
    for ttft_abs, tpot_abs in zip(*columns, strict=True):
        norm = [0.5 if flat[k] else (v - lows[k]) / ranges[k]
                for k, v in enumerate((ttft_abs, tpot_abs))]
        blend = alpha * norm[0] + beta * norm[1]
        raw = 1.0 - blend if prefer_least else blend
        scores.append((int(raw * SCORE_RESOLUTION) + 1) / SCORE_RESOLUTION)
    return scores


def latency_scores(endpoints: Sequence[Endpoint], config: PredictedLatencyConfig) -> list[float]:
    """latency-scorer on predictions. Endpoints predicted to meet both SLOs are
    scored. If none does, idle endpoints are scored, else the least severe deficit
    bucket: TPOT-only misses, then TTFT-only, then both. The strategy is always
    "least" for negative headroom. Endpoints outside the scored set get 0."""
    positive = [i for i, e in enumerate(endpoints) if e.meets_slo]
    if positive:
        chosen, prefer_least = positive, config.prefer_least_headroom
    else:
        buckets = (
            [i for i, e in enumerate(endpoints) if e.num_dispatched == 0],
            [i for i, e in enumerate(endpoints) if e.ttft_headroom_s >= 0],  # TPOT misses only
            [i for i, e in enumerate(endpoints) if e.tpot_headroom_s >= 0],  # TTFT misses only
        )
        chosen = next((b for b in buckets if b), list(range(len(endpoints))))
        prefer_least = True
    scores = headroom_scores(
        [(endpoints[i].ttft_headroom_s, endpoints[i].tpot_headroom_s) for i in chosen],
        config.ttft_weight, config.tpot_weight, prefer_least)
    by_index = dict(zip(chosen, scores, strict=True))
    return [by_index.get(i, 0.0) for i in range(len(endpoints))]


def composite_scores(endpoints: Sequence[Endpoint], config: PredictedLatencyConfig) -> list[float]:
    """latency-scorer's fallback without predictions: a weighted blend of free KV, the
    queue relative to the longest one, and the prefix-cache score."""
    weights = (config.composite_kv_weight, config.composite_queue_weight,
               config.composite_prefix_weight)
    total = sum(weights)
    kv_w, queue_w, prefix_w = (w / total for w in weights) if total > 0 else (1.0, 0.0, 0.0)
    max_waiting = max(e.inst.num_waiting for e in endpoints)
    scores = []
    for e in endpoints:
        rel_queue = (max_waiting - e.inst.num_waiting) / max_waiting if max_waiting else 1.0
        blend = (kv_w * (1 - e.features.kv_cache_percentage) + queue_w * rel_queue
                 + prefix_w * e.features.prefix_cache_score)
        scores.append(math.floor(blend * SCORE_RESOLUTION + 0.5) / SCORE_RESOLUTION)
    return scores


def weighted_random_pick(endpoints: Sequence[Endpoint], scores: Sequence[float],
                         rng: random.Random) -> Endpoint:
    """weighted-random-picker: A-Res keys u^(1/score), largest wins; uniform if all 0."""
    if all(s <= 0 for s in scores):
        return rng.choice(endpoints)
    keys = [(rng.random() or 1e-10) ** (1.0 / s) if s > 0 else 0.0 for s in scores]
    return endpoints[keys.index(max(keys))]


@dataclass(frozen=True)
class Dispatch:
    """A request in flight: where it went and what the predictor saw there."""

    instance_id: InstanceId
    features: LatencyFeatures  # prefill in flight counts the request itself, as in training
    num_prefill_tokens: int


class PredictedLatencyPolicy(SeededPolicy):
    """llm-d's predicted-latency profile (see the module docstring). The regressor is
    trained on the features captured at dispatch: a TTFT sample (first token - arrival)
    at the request's first token, as llm-d's streaming mode sends it
    (`processFirstTokenForLatencyPrediction` in llm-d/llm-d-inference-scheduler,
    `pkg/epp/framework/plugins/requestcontrol/dataproducer/predictedlatency/
    requestcontrol_hooks.go`), and a TPOT sample ((finish - first token) /
    (outputs - 1)) at its finish.

    - Tier filter: keeps the endpoints predicted to meet both SLOs, but keeps the
      others instead 1% of the time.
    - TPOT budget: the request's TPOT SLO, lowered to the tightest TPOT SLO among the
      requests still running on that endpoint.
    - Cold start: until the sidecar has fitted on 10 samples, scoring falls back to
      the scorer's composite of free KV, relative queue and prefix score. The real
      sidecar would answer with a constant 10 ms prior, which ties every endpoint.
    - Runs llm-d's streaming mode, which its per-request TTFT and TPOT SLOs need:
      both models are trained, and both headrooms are checked.
    - Prefill tokens in flight count on the serving endpoint until the request
      finishes, as llm-d counts them there (only a separate prefill pod's count
      drops at the first token: `ResponseBody`, same file).

    Deviations:
    - One TPOT sample per request, its mean time per output token at its finish;
      llm-d's streaming mode sends each inter-token time as it comes
      (`processTokenForLatencyPrediction`, same file), which a policy does not hear.
    - Input length counts tokens, not words.
    - The sidecar's gated no-queue/queued sub-models and 10% hold-out are left out.
    - No admission: the latency-slo-admitter sheds only negative-priority requests.
    """

    deadline_aware: ClassVar[bool] = True

    def __init__(self, seed: int = 0, config: PredictedLatencyConfig | None = None,
                 model: OnlineLatencyModel | None = None) -> None:
        super().__init__(seed)
        self.config = config or PredictedLatencyConfig()
        c = self.config
        self.model = model or OnlineLatencyModel(
            c.quantile, c.min_samples_to_fit, c.model_sync_interval_s,
            c.max_samples_per_bucket)
        self._dispatched: dict[str, Dispatch] = {}  # request id -> dispatch
        self._prefill_tokens_on: Counter[InstanceId] = Counter()
        # instance -> request id -> its TPOT SLO (0 when it has none), for running requests
        self._tpot_slos_on: dict[InstanceId, dict[str, float]] = {}

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        endpoints = self.endpoints(request, candidates, view, now)
        endpoints = self._affinity(endpoints, self.config.strict_affinity_threshold)
        endpoints = self._headroom_tier(endpoints)
        endpoints = self._affinity(endpoints, self.config.loose_affinity_threshold)
        if endpoints[0].ttft_s is None:
            scores = composite_scores(endpoints, self.config)
        else:
            scores = latency_scores(endpoints, self.config)
        chosen = weighted_random_pick(endpoints, scores, self.rng)
        self._dispatch(request, chosen)
        return chosen.inst.instance_id

    def endpoints(self, request: RouteRequest, candidates: Sequence[InstanceView],
                  view: ClusterView, now: float) -> list[Endpoint]:
        """Each candidate with its features, predictions (by the model in use at `now`)
        and headrooms."""
        hits = view.prefix_hits_of(request, [v.instance_id for v in candidates])
        features = [self._features(request, v, int(h))
                    for v, h in zip(candidates, hits, strict=True)]
        predicted = self.model.predict(features, now)
        if predicted is None:
            return [Endpoint(v, f, None, None, 0.0, 0.0, self._num_dispatched(v))
                    for v, f in zip(candidates, features, strict=True)]
        buffer = self.config.slo_buffer_factor
        endpoints = []
        for v, f, ttft_s, tpot_s in zip(candidates, features, *predicted, strict=True):
            tpot_budget_s = (request.tpot_slo_s or 0.0) * buffer
            tightest_s = min(self._tpot_slos_on.get(v.instance_id, {}).values(), default=0.0)
            if tightest_s > 0:  # 0: nothing running, or a running request without a TPOT SLO
                tpot_budget_s = min(tpot_budget_s, tightest_s * buffer)
            endpoints.append(Endpoint(
                v, f, float(ttft_s), float(tpot_s), (request.ttft_slo_s or 0.0) - float(ttft_s),
                tpot_budget_s - float(tpot_s), self._num_dispatched(v)))
        return endpoints

    def _features(self, request: RouteRequest, inst: InstanceView,
                  hit_tokens: int) -> LatencyFeatures:
        used = inst.num_kv_blocks - inst.num_kv_blocks_free
        return LatencyFeatures(
            kv_cache_percentage=used / inst.num_kv_blocks if inst.num_kv_blocks else 0.0,
            input_token_length=request.num_context_tokens,
            num_request_waiting=inst.num_waiting,
            num_request_running=inst.num_running,
            prefill_tokens_in_flight=self._prefill_tokens_on[inst.instance_id],
            prefix_cache_score=hit_tokens / request.num_prompt_tokens
            if request.num_prompt_tokens else 0.0,
        )

    def _num_dispatched(self, inst: InstanceView) -> int:
        return len(self._tpot_slos_on.get(inst.instance_id, {}))

    def _affinity(self, endpoints: list[Endpoint], threshold: float) -> list[Endpoint]:
        """prefix-cache-affinity-filter: keep the endpoints whose prefix score reaches
        `threshold`. If none does, or with 1% exploration, keep all. Also keep all when
        the best sticky TTFT is more than 5 s worse than the best non-sticky one."""
        if len(endpoints) <= 1 or threshold <= 0:
            return endpoints
        if self.rng.random() < self.config.affinity_exploration_probability:
            return endpoints
        sticky = [e for e in endpoints if e.features.prefix_cache_score >= threshold]
        rest = [e for e in endpoints if e.features.prefix_cache_score < threshold]
        if not sticky:
            return endpoints
        if rest and self.config.max_ttft_penalty_s > 0 and sticky[0].ttft_s is not None:
            penalty_s = min(e.ttft_s for e in sticky) - min(e.ttft_s for e in rest)
            if penalty_s > self.config.max_ttft_penalty_s:
                return endpoints
        return sticky

    def _headroom_tier(self, endpoints: list[Endpoint]) -> list[Endpoint]:
        """slo-headroom-tier-filter: the tier predicted to meet both SLOs, except with
        probability `epsilon_explore_negative`; whichever tier exists if only one does."""
        if len(endpoints) <= 1 or endpoints[0].ttft_s is None:
            return endpoints
        positive = [e for e in endpoints if e.meets_slo]
        negative = [e for e in endpoints if not e.meets_slo]
        if positive and negative:
            explore = self.rng.random() < self.config.epsilon_explore_negative
            return negative if explore else positive
        return positive or negative

    def _dispatch(self, request: RouteRequest, chosen: Endpoint) -> None:
        self._forget(request.request_id)  # a re-routed request leaves its previous instance
        iid, tokens = chosen.inst.instance_id, request.num_context_tokens
        self._prefill_tokens_on[iid] += tokens
        features = replace(chosen.features, prefill_tokens_in_flight=self._prefill_tokens_on[iid])
        self._dispatched[request.request_id] = Dispatch(iid, features, tokens)
        self._tpot_slos_on.setdefault(iid, {})[request.request_id] = request.tpot_slo_s or 0.0

    def _forget(self, request_id: str) -> Dispatch | None:
        dispatch = self._dispatched.pop(request_id, None)
        if dispatch is not None:
            self._prefill_tokens_on[dispatch.instance_id] -= dispatch.num_prefill_tokens
            del self._tpot_slos_on[dispatch.instance_id][request_id]
        return dispatch

    def on_first_token(self, request: RouteRequest, instance_id: InstanceId,
                       first_token_s: float, now: float) -> None:
        dispatch = self._dispatched.get(request.request_id)
        if dispatch is not None:
            self.model.add(dispatch.features, first_token_s - request.arrival_s, None, now)

    def on_finish(self, report: FinishReport, now: float) -> None:
        dispatch = self._forget(report.request.request_id)
        if dispatch is None or report.first_token_s is None or report.num_output_tokens < 2:
            return
        tpot_s = (report.finish_s - report.first_token_s) / (report.num_output_tokens - 1)
        self.model.add(dispatch.features, None, tpot_s, now)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self._forget(request.request_id)
