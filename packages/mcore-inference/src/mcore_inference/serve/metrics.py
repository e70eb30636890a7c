"""``/metrics``: the server's state in the Prometheus text exposition format (version 0.0.4).

Gauges come from the engine loop's latest statistics (queue depth, running requests, KV blocks,
tokens per second); counters and the time-to-first-token histogram are kept here, on the event
loop. The format is written directly (a few lines per metric) so the server needs no client
library; the tests read it back with ``prometheus_client``'s parser.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence

from mcore_inference.serve.engine_loop import LoopFrontend

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Content type of the Prometheus text format."""

_PREFIX = "mcore_inference_"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            label = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{{labels},le="{label}"}} {cumulative}')
        lines.append(f"{name}_sum{{{labels}}} {_number(self.total)}")
        lines.append(f"{name}_count{{{labels}}} {self.count}")
        return lines


class ServerMetrics:
    """Counters of the HTTP side plus the engine loop's gauges.

    Args:
        loop: The engine loop whose statistics the gauges show.
        model: Served model name (a label on every sample).
    """

    def __init__(self, loop: LoopFrontend, model: str) -> None:
        self._loop = loop
        self._model = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self.responses: Counter[tuple[str, int]] = Counter()
        """Answered requests by (endpoint, HTTP status)."""
        self.finished: Counter[str] = Counter()
        """Finished choices by finish reason (``stop``, ``length``, ``abort``, ``error``)."""
        self.prompt_tokens = 0
        """Prompt tokens of accepted requests."""
        self.time_to_first_token = _Histogram(_TTFT_BUCKETS)
        """Seconds from submission to the first generated token, per choice."""

    def observe_first_token(self, seconds: float) -> None:
        """Record one choice's time to first token.

        Args:
            seconds: Time from submission to the first token.
        """
        self.time_to_first_token.observe(seconds)

    def render(self) -> str:
        """The exposition text.

        Returns:
            Every metric with its HELP and TYPE lines.
        """
        stats = self._loop.stats
        model = f'model_name="{self._model}"'
        blocks = stats.kv_blocks_total
        gauges = (
            ("requests_waiting", "Requests waiting for a batch slot.", self._loop.num_waiting),
            ("requests_running", "Requests holding a batch slot and KV blocks.", stats.num_running),
            ("kv_cache_blocks_used", "KV-cache blocks held by requests.", stats.kv_blocks_used),
            ("kv_cache_blocks_total", "KV-cache blocks that can be handed out.", blocks),
            (
                "kv_cache_usage_ratio",
                "Fraction of the KV-cache blocks held by requests.",
                stats.kv_blocks_used / blocks if blocks else 0.0,
            ),
            (
                "generation_tokens_per_second",
                "Tokens generated per second over the last ten seconds.",
                self._loop.generation_tokens_per_second(),
            ),
            ("engine_healthy", "1 while the engine loop serves requests.", int(self._loop.running)),
        )
        lines: list[str] = []
        for name, doc, value in gauges:
            full = _PREFIX + name
            lines += [f"# HELP {full} {doc}", f"# TYPE {full} gauge"]
            lines.append(f"{full}{{{model}}} {_number(value)}")
        counters = (
            ("generation_tokens", "Tokens generated.", stats.generation_tokens_total),
            ("prompt_tokens", "Prompt tokens of accepted requests.", self.prompt_tokens),
            ("engine_steps", "Engine steps run.", stats.steps_total),
        )
        for name, doc, value in counters:
            full = _PREFIX + name
            lines += [f"# HELP {full}_total {doc}", f"# TYPE {full}_total counter"]
            lines.append(f"{full}_total{{{model}}} {value}")
        full = _PREFIX + "rank_kv_cache_blocks_used"
        lines += [
            f"# HELP {full} KV-cache blocks held by requests on each engine rank.",
            f"# TYPE {full} gauge",
        ]
        for rank, used in enumerate(self._loop.rank_kv_blocks_used()):
            lines.append(f'{full}{{{model},rank="{rank}"}} {used}')
        full = _PREFIX + "http_responses_total"
        lines += [f"# HELP {full} HTTP answers by endpoint and status.", f"# TYPE {full} counter"]
        for (endpoint, status), count in sorted(self.responses.items()):
            lines.append(f'{full}{{{model},endpoint="{endpoint}",status="{status}"}} {count}')
        full = _PREFIX + "request_finished_total"
        lines += [f"# HELP {full} Finished choices by reason.", f"# TYPE {full} counter"]
        for reason, count in sorted(self.finished.items()):
            lines.append(f'{full}{{{model},finish_reason="{reason}"}} {count}')
        full = _PREFIX + "time_to_first_token_seconds"
        lines += [
            f"# HELP {full} Seconds from submission to the first token.",
            f"# TYPE {full} histogram",
        ]
        lines += self.time_to_first_token.lines(full, model)
        return "\n".join(lines) + "\n"
