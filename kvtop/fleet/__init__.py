"""Many engines at once: each target's `/metrics` polled concurrently, bounded and time-limited."""

from kvtop.fleet.poller import Fleet, Row

__all__ = ["Fleet", "Row"]
