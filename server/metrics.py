"""Every Prometheus metric xlserve exports, on a registry created per app.

Names follow vLLM's style (xlserve_<what>_<unit>), all labelled by model.

The server runs two processes (server/engine/process.py, docs/design.md section 8) and each
creates a `Metrics`. Each family is recorded by exactly one of them: the API process records
what a client sees (every HTTP response by route and status, time to first token, inter-token
and end-to-end latency as streamed, errors by type and code, memory reuse and state size at
commit), the engine process's restarts and its own process metrics (`process_*`,
prometheus_client's process collector) (`is_api_family`); the engine process records the rest (tokens, queue, request
phases, batch sizes, outcomes, the session cache and its tiers' budgets) and its own process
metrics as `xlserve_engine_process_*` (the same collector, reading the engine process's /proc/self).
/metrics renders both halves into one exposition.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from xlserve.server.errors import error_codes

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# a request's phases and an HTTP response's whole time (a stream lasts as long as its generation)
REQUEST_BUCKETS = LATENCY_BUCKETS + (120, 300, 600, 1800)
BYTES_BUCKETS = tuple(2**i for i in range(10, 34, 2))
# Batch sizes are whole numbers: each bound n has a bound just below it, so that a quantile
# falling among steps of exactly n rows reads n (histogram_quantile interpolates inside the
# (n - 0.001, n] bucket), not a value between n and the bound below (0.5 for steps of one row).
BATCH_SIZE_BUCKETS = tuple(bound for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) for bound in (n - 0.001, n))
# prompt tokens a request's prefill computed: 0 (all of it from the prefix cache), then one
# bucket per factor of 4 up to 4M tokens (a 300 KB document is 300,000 byte tokens)
PREFILL_TOKENS_BUCKETS = (0,) + tuple(4**i for i in range(12))


API_FAMILIES = frozenset({
    "xlserve_time_to_first_token_seconds", "xlserve_inter_token_latency_seconds",
    "xlserve_e2e_request_latency_seconds", "xlserve_request_errors", "xlserve_memory_reused_tokens",
    "xlserve_state_bytes_per_session", "xlserve_engine_restarts", "xlserve_http_requests",
    "xlserve_http_request_duration_seconds", "xlserve_requests_not_committed",
})
# each process's own CPU, memory and file descriptors: prometheus_client's process collector,
# under its usual names (process_*) for the API process and in this namespace
# (xlserve_engine_process_*) for the engine process
ENGINE_PROCESS_NAMESPACE = "xlserve_engine"
# an HTTP request no route matches (a scanner's path, a typo): one label value, so the route
# label has as many values as the app has routes, whatever paths clients send; likewise a method
# that is none of HTTP's own (a client may send any word) is OTHER_METHOD
UNMATCHED_ROUTE = "unmatched"
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
OTHER_METHOD = "other"
# the `code` of xlserve_request_errors_total: one of the error registry's codes
# (server/errors.py `error_codes`), NO_CODE for an error that carries none, and UNREGISTERED_CODE
# for a code the registry lacks (a bug tests/server/test_http_metrics.py is there to catch),
# so that the label never takes a value nobody declared
NO_CODE = "none"
UNREGISTERED_CODE = "unregistered"


def error_code_label(code: object) -> str:
    """The `code` label value of an error whose body carries `code`. The registry is read as
    imported so far, and this module imports no layer (docs/design.md section 1): errors are
    counted, and their series declared, in the API process, whose server/api/errors.py imports
    the engine's and the cache's errors modules, so every class is registered there."""
    if code is None:
        return NO_CODE
    return code if isinstance(code, str) and code in error_codes() else UNREGISTERED_CODE


def is_api_family(name: str) -> bool:
    """Whether the API process records (and renders) the family `name`."""
    return name in API_FAMILIES or name.startswith("process_")


class _Families:
    """A registry seen through a filter on family names (for generate_latest)."""

    def __init__(self, registry: CollectorRegistry, keep):
        self.registry, self.keep = registry, keep

    def collect(self):
        return [family for family in self.registry.collect() if self.keep(family.name)]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("xlserve_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("xlserve_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.memory_reused_tokens = Counter(
            "xlserve_memory_reused_tokens",
            "Context tokens served from a session's memory instead of being recomputed",
            ["model"], registry=r,
        )
        self.requests = Counter(
            "xlserve_requests", "Finished requests, once each, by how they ended: the (first) choice's finish "
            "reason, cancelled, or appended", ["model", "finish_reason"], registry=r
        )
        # a request counted above whose answer then failed, in the API process: its commit refused
        # (a conflict, a full tier) or not known to have landed, or its answer too large to remember.
        # It is also in xlserve_request_errors_total: an error ratio over every request subtracts it
        # from the finished ones, or such a request counts twice in the denominator
        self.requests_not_committed = Counter(
            "xlserve_requests_not_committed", "Requests counted in xlserve_requests_total as finished whose answer "
            "then failed before its commit landed (each also counted in xlserve_request_errors_total)", ["model"],
            registry=r)
        # the API process starts a new engine process when one dies: every model it served is
        # counted, so the series follows the dashboard's model filter like every other
        self.engine_restarts = Counter(
            "xlserve_engine_restarts", "Times the engine process died and a new one was started (once a death, at its "
            "first start, however many attempts it took)", ["model"], registry=r
        )
        # every error a client is answered with (an HTTP error status, an error event in a stream,
        # an error frame on the websocket), counted once where it is answered (server/api/errors.py);
        # model is "" when the request names no model the server serves; type and code are the
        # error body's (code: `error_code_label`), so that errors of one type ("model not found"
        # and "session not found", both not_found_error) can be told apart
        self.request_errors = Counter("xlserve_request_errors", "Failed requests by error type and code",
                                      ["model", "type", "code"], registry=r)
        # every HTTP response, as prometheus-fastapi-instrumentator counts them: by the route's path
        # template (never the raw path), method and status code; a stream once, when it ends; a
        # websocket handshake as GET with 101 (accepted) or the status it was refused with
        self.http_requests = Counter(
            "xlserve_http_requests", "HTTP responses by route template, method and status code",
            ["route", "method", "status"], registry=r,
        )
        self.http_request_duration = Histogram(
            "xlserve_http_request_duration_seconds",
            "HTTP request arrival to the last byte of its response (a stream's end), by route template and method",
            ["route", "method"], buckets=REQUEST_BUCKETS, registry=r,
        )
        self.requests_running = Gauge("xlserve_requests_running", "Requests being processed", ["model"], registry=r)
        self.requests_waiting = Gauge(
            "xlserve_requests_waiting", "Requests queued for a place in the running batch", ["model"], registry=r
        )
        # a request's phases in the engine, as vLLM's request_{queue,prefill,decode}_time_seconds:
        # queued until first scheduled into the batch, scheduled until its first token (an append's
        # or a max_tokens=0 request's: until its prompt is in the state), first token until finished
        self.request_queue_time = Histogram(
            "xlserve_request_queue_time_seconds", "Time a request waited in the queue before it was scheduled",
            ["model"], buckets=REQUEST_BUCKETS, registry=r,
        )
        self.request_prefill_time = Histogram(
            "xlserve_request_prefill_time_seconds", "Time from a request's scheduling to its first token",
            ["model"], buckets=REQUEST_BUCKETS, registry=r,
        )
        self.request_decode_time = Histogram(
            "xlserve_request_decode_time_seconds", "Time from a request's first token to its last",
            ["model"], buckets=REQUEST_BUCKETS, registry=r,
        )
        # what fair prefill shares (Engine._prefill_plan): the prompt tokens each request ran
        # through the model, observed when its prompt is in the state (a prefix hit's not counted)
        self.prefill_tokens = Histogram(
            "xlserve_prefill_tokens", "Prompt tokens each request prefilled (computed, not reused)", ["model"],
            buckets=PREFILL_TOKENS_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "xlserve_batch_size", "Rows in each batched decode step", ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r,
        )
        # up to half an hour, as the queue, prefill and decode times: 4,096 tokens after a 1 MB prompt
        # take minutes on a CPU, which 60 s buckets would clamp (the p99 panels and the TTFT alert)
        self.e2e_latency = Histogram(
            "xlserve_e2e_request_latency_seconds", "Request latency, arrival to last token", ["model"],
            buckets=REQUEST_BUCKETS, registry=r,
        )
        self.time_to_first_token = Histogram(
            "xlserve_time_to_first_token_seconds", "Arrival to first generated token", ["model"],
            buckets=REQUEST_BUCKETS, registry=r,
        )
        self.inter_token_latency = Histogram(
            "xlserve_inter_token_latency_seconds", "Time between generated tokens", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.sessions = Gauge("xlserve_sessions", "Live sessions per tier", ["model", "tier"], registry=r)
        self.session_state_bytes = Gauge("xlserve_session_state_bytes", "Bytes of session state per tier", ["model", "tier"], registry=r)
        self.state_bytes_per_session = Histogram(
            "xlserve_state_bytes_per_session", "State bytes of a session at commit", ["model"],
            buckets=BYTES_BUCKETS, registry=r,
        )
        # the last tier's writes (server/cache/durable.py): a commit appends a delta block, or
        # writes the session whole (a model whose state changes as a whole, an import), or
        # compacts its log into a whole copy; a fork on disk copies a log and links a base
        self.session_commit_bytes = Counter(
            "xlserve_session_commit_bytes", "Bytes written to the durable tier, by kind of write (delta, whole, "
            "compaction, fork)", ["model", "kind"], registry=r)
        self.session_commit_writes = Counter(
            "xlserve_session_commit_writes", "Writes to the durable tier, by kind (delta, whole, compaction, fork)",
            ["model", "kind"], registry=r)
        # compactions behind a commit's answer (server/cache/compactor.py), by outcome: compacted,
        # busy (a request held the session: its next commit asks again), moved_on (another replica
        # committed first, with Redis; or, on disk, the log was gone already), failed (the store refused or did not answer; the log stays)
        self.session_compactions = Counter(
            "xlserve_session_compactions", "Compactions behind a commit's answer, by outcome (compacted, busy, "
            "moved_on, failed)", ["model", "outcome"], registry=r)
        self.session_compaction_seconds = Histogram(
            "xlserve_session_compaction_seconds", "Time a compaction behind a commit's answer held its session "
            "(a request for it waits meanwhile)", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        # session cache (server/cache): hits/misses count where an acquired session was found
        # (a hit on that tier, a miss on every faster one); evictions count moves down, by tier left
        self.session_cache_hits = Counter("xlserve_session_cache_hits", "Sessions found in a tier", ["model", "tier"], registry=r)
        self.session_cache_misses = Counter("xlserve_session_cache_misses", "Sessions not found in a tier", ["model", "tier"], registry=r)
        self.session_promotions = Counter(
            "xlserve_session_promotions", "Sessions restored to the device, by tier they came from", ["model", "tier"], registry=r
        )
        self.session_evictions = Counter(
            "xlserve_session_evictions", "Sessions moved down out of a tier", ["model", "tier"], registry=r
        )
        self.session_refusals = Counter(
            "xlserve_session_refusals", "Requests refused because a tier had no room (503)", ["model", "tier"], registry=r
        )
        # the prefix-state cache (server/cache/prefix_cache.py), named after vLLM's prefix_cache_*
        self.prefix_cache_queries = Counter(
            "xlserve_prefix_cache_queries", "Prompt tokens of requests without a session looked up in the prefix cache",
            ["model"], registry=r,
        )
        self.prefix_cache_hits = Counter(
            "xlserve_prefix_cache_hits", "Prompt tokens found in the prefix cache (not recomputed)", ["model"], registry=r
        )
        self.prefix_cache_entries = Gauge("xlserve_prefix_cache_entries", "Prefix-cache entries per tier",
                                          ["model", "tier"], registry=r)
        self.prefix_cache_bytes = Gauge("xlserve_prefix_cache_bytes", "Bytes of prefix-cache states per tier",
                                        ["model", "tier"], registry=r)
        self.prefix_cache_evictions = Counter("xlserve_prefix_cache_evictions", "Prefix-cache entries evicted (LRU)",
                                              ["model"], registry=r)
        self.session_restore_latency = Histogram(
            "xlserve_session_restore_latency_seconds", "Time to bring a session's state back to the device",
            ["model", "tier"], buckets=(0.0001, 0.00025, 0.0005) + LATENCY_BUCKETS, registry=r,
        )
        # how full each tier is (vLLM's kv_cache_usage_perc): the tiers are shared by every model,
        # so no model label; a tier without a budget (redis: Redis's maxmemory bounds it) has neither.
        # Session states only: the room prefix-cache entries borrow is given back on demand, so it
        # counts as free, as vLLM counts cached blocks nobody uses as free
        self.session_cache_budget = Gauge(
            "xlserve_session_cache_budget_bytes", "Byte budget of each session-cache tier (XLSERVE_*_STATE_BYTES)",
            ["tier"], registry=r,
        )
        self.session_cache_usage = Gauge(
            "xlserve_session_cache_usage_ratio", "Fraction of each session-cache tier's budget its states hold (1 = full)",
            ["tier"], registry=r,
        )
        # which tier holds every committed session (1 on its label): disk without Redis, where the
        # disk filling up refuses sessions; redis with it, where the disk is a spill cache that
        # fills by design (deploy/prometheus/alerts.yml tells them apart by this)
        self.session_cache_last_tier = Gauge(
            "xlserve_session_cache_last_tier", "1 for the tier that holds every committed session (disk or redis)",
            ["tier"], registry=r,
        )
        ProcessCollector(registry=r)  # process_*: rendered by the API process, of itself
        # xlserve_engine_process_*: rendered by the engine process, of itself (its /proc/self)
        ProcessCollector(namespace=ENGINE_PROCESS_NAMESPACE, registry=r)

    # -- series that exist before their first event ----------------------------------------------
    # A counter appears at its first increment, so without these the first error, refusal or
    # eviction reads as a rate of 0 (there was no earlier sample) and alerts on it cannot fire.

    FINISH_REASONS = ("stop", "length", "no_allowed_token", "cancelled")
    COMPACTION_OUTCOMES = ("compacted", "busy", "moved_on", "failed")  # server/cache/session_cache.py `compact`

    def declare_engine_series(self, models: list[str], tiers: list[str]) -> None:
        """The engine process's counters at 0 for every model, finish reason, compaction outcome and
        cache tier."""
        for model in models:
            for counter in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries,
                            self.prefix_cache_hits, self.prefix_cache_evictions):
                counter.labels(model)
            for reason in self.FINISH_REASONS:
                self.requests.labels(model, reason)
            for outcome in self.COMPACTION_OUTCOMES:
                self.session_compactions.labels(model, outcome)
            self.session_compaction_seconds.labels(model)  # its buckets at 0 too: the panel has a series
            for tier in tiers:
                for counter in (self.session_cache_hits, self.session_cache_misses, self.session_promotions,
                                self.session_evictions, self.session_refusals):
                    counter.labels(model, tier)

    def declare_api_series(self, models: list[str], error_types: list[str]) -> None:
        """The API process's counters at 0 for every model, and errors for every model (and model
        "", requests that name no served model) by each error type without a code and with each
        registered code of that type (server/errors.py `error_codes`): the pairs a client can be
        answered with, not every type with every code."""
        for model in models:
            self.memory_reused_tokens.labels(model)
            self.engine_restarts.labels(model)
            self.requests_not_committed.labels(model)
        pairs = [(error_type, NO_CODE) for error_type in error_types]
        pairs += [(error_type, code) for code, error_type in error_codes().items() if error_type in error_types]
        for model in [*models, ""]:
            for error_type, code in pairs:
                self.request_errors.labels(model, error_type, code)

    def declare_http_series(self, responses: list[tuple[str, str, int]]) -> None:
        """xlserve_http_requests_total at 0 for each (route template, method, status)."""
        for route, method, status in responses:
            self.http_requests.labels(route, method, str(status))

    def declare_tiers(self, budgets: dict[str, int | None], used, last_tier: str) -> None:
        """Each tier's budget, and its usage ratio read at every scrape from `used(tier)` (bytes
        held there now: CacheManager.used), for the tiers that have a budget; and `last_tier`,
        the one that holds every committed session."""
        self.session_cache_last_tier.labels(last_tier).set(1)
        for tier, budget in budgets.items():
            if budget is None:
                continue
            self.session_cache_budget.labels(tier).set(budget)
            self.session_cache_usage.labels(tier).set_function(
                lambda tier=tier, budget=budget: used(tier) / budget if budget > 0 else float(used(tier) > 0))

    def render(self, engine_side: bool | None = None) -> bytes:
        """The exposition: every family (None; process metrics twice, both of this process), the
        engine process's half (True) or the API process's half (False)."""
        if engine_side is None:
            return generate_latest(self.registry)
        return generate_latest(_Families(self.registry, lambda name: is_api_family(name) != engine_side))
