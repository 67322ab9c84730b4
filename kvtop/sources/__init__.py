"""Where the dashboard's frames come from: one interface (`base`), one module per kind.

`LiveSource` polls our engine over its control socket (and carries the operator actions);
`ReplaySource` plays the frames of a `.kvsnap` snapshot; `MetricsSource` reads any engine's
Prometheus `/metrics` (vLLM, SGLang, llama.cpp, ours) into a partial frame.
"""

from kvtop.sources.base import (
    BURSTY_EVENTS,
    EVENTS_KEPT,
    HISTORY_S,
    NOTABLE_EVENTS,
    FrameSource,
    SourceUnavailable,
)
from kvtop.sources.live import LiveSource
from kvtop.sources.replay import SPEEDS, ReplaySource, parse_offset

__all__ = [
    "BURSTY_EVENTS",
    "EVENTS_KEPT",
    "HISTORY_S",
    "NOTABLE_EVENTS",
    "SPEEDS",
    "FrameSource",
    "LiveSource",
    "ReplaySource",
    "SourceUnavailable",
    "parse_offset",
]
