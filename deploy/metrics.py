"""The endpoint's Prometheus metrics, through Ray's metrics API: requests, TTFT, time per token."""

from __future__ import annotations

import time

from ray.util.metrics import Counter, Histogram

LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class RequestMetrics:
    def __init__(self, model: str):
        self.tags = {"model": model}
        self.requests = Counter("metrale_http_requests_total", "HTTP requests by route and status",
                                ("model", "route", "status"))
        self.ttft = Histogram("metrale_time_to_first_token_seconds",
                              "From request arrival to its first token", LATENCY_BOUNDARIES,
                              ("model",))
        self.tpot = Histogram("metrale_time_per_output_token_seconds",
                              "Mean gap between a request's tokens after the first",
                              LATENCY_BOUNDARIES, ("model",))
        self.tokens = Counter("metrale_generated_tokens_total", "Completion tokens streamed out",
                              ("model",))

    def answered(self, route: str, status: int) -> None:
        self.requests.inc(1, self.tags | {"route": route, "status": str(status)})

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """Times one request's tokens as they leave the endpoint."""

    def __init__(self, metrics: RequestMetrics):
        self.metrics, self.start = metrics, time.perf_counter()
        self.first: float | None = None
        self.count = 0

    def tokens(self, n: int) -> None:
        if n and self.first is None:
            self.first = time.perf_counter()
            self.metrics.ttft.observe(self.first - self.start, self.metrics.tags)
        self.count += n

    def done(self) -> None:
        if self.count:
            self.metrics.tokens.inc(self.count, self.metrics.tags)
        if self.first is not None and self.count > 1:
            self.metrics.tpot.observe((time.perf_counter() - self.first) / (self.count - 1),
                                      self.metrics.tags)
