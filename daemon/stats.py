"""Counters and latency percentiles kept by the socket thread (its only writer), for `stats`."""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from typing import Any, Optional

WINDOW = 1000          # latencies of the last this many completed requests


def plain(value: Any) -> Any:
    """Turn engine values (numpy scalars, tuples, enums) into msgpack-safe plain ones."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    for cast in (int, float):
        if hasattr(value, "__index__" if cast is int else "__float__"):
            try:
                return plain(cast(value))
            except (TypeError, ValueError):
                pass
    return str(value)


def percentiles(values, qs=(50, 90, 99)) -> dict:
    if not values:
        return {f"p{q}": None for q in qs}
    s = sorted(values)
    return {f"p{q}": round(s[min(len(s) - 1, int(math.ceil(q / 100 * len(s))) - 1)], 3) for q in qs}


class ServerStats:
    def __init__(self):
        self.ends: Counter = Counter()     # finish reason -> count
        self.busy = 0
        self.dropped_clients = 0
        self._ttft_ms: deque = deque(maxlen=WINDOW)
        self._e2e_ms: deque = deque(maxlen=WINDOW)
        self._queued_ms: deque = deque(maxlen=WINDOW)

    def record_end(self, flight, reason: str, metrics: Optional[dict] = None) -> None:
        self.ends[reason] += 1
        now = time.monotonic()
        self._e2e_ms.append((now - flight.arrival) * 1000)
        if flight.first_token_at is not None:
            self._ttft_ms.append((flight.first_token_at - flight.arrival) * 1000)
        if metrics and metrics.get("queued_s") is not None:
            self._queued_ms.append(float(metrics["queued_s"]) * 1000)

    def snapshot(self) -> dict:
        return {
            "finished": dict(self.ends),
            "refused_busy": self.busy,
            "dropped_clients": self.dropped_clients,
            "latency_ms": {"ttft": percentiles(self._ttft_ms), "e2e": percentiles(self._e2e_ms),
                           "queued": percentiles(self._queued_ms)},
        }
