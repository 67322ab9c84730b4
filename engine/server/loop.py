"""EngineLoop: the engine's own thread, and the bridge between it and the asyncio handlers.

The thread calls `engine.step()` while there is work and sleeps on an event otherwise, so HTTP
stays responsive while the model computes. Handlers `submit` requests with a sink (a callable
run on the event loop, e.g. a queue's `put_nowait`); each RequestOutput is handed over with
`call_soon_threadsafe`. Between steps the thread records a frame every `stats_interval` into the
flight recorder, checks the automatic-snapshot triggers, and enforces the drain deadline (the
drain itself, its state and its deadline, is the engine's: `engine.drain_state`, engine/drain.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from engine.drain import EngineState
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.runtime.log import log
from engine.runtime.openmp import release_thread_pool
from engine.sampling import SamplingParams
from engine.server.triggers import SnapshotTriggers
from engine.telemetry.flight_recorder import FlightRecorder
from kvtop.protocol.config import ServerConfig
from kvtop.protocol.snapshot import check_target, write_snapshot

Sink = Callable[[RequestOutput], None]
RECENT_SNAPSHOTS = 10
EVICT_POLL_S = 0.005  # how often a waiting eviction looks whether the engine thread has applied it


class EngineLoop:
    # About 250 lines, kept whole: one thread's bridge (requests in, outputs out, controls,
    # frames and snapshots between steps) whose parts share its wake event and its sinks.
    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.recorder = FlightRecorder(config.history, config.stats_interval)
        self.triggers = SnapshotTriggers(config)
        self.inflight = 0  # engine requests submitted and not yet finished (event-loop side)
        self.finish_reasons: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.snapshots: list[dict] = []
        self.snapshot_counts: Counter[str] = Counter()
        self.addresses: dict[str, str] = {}
        self._sinks: dict[str, Sink] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._snapshot_lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        self._aloop = aloop
        self._record(time.time())
        self._thread = threading.Thread(target=self._run, name="kvtop-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests (called on the event loop) ---------------------------------------------
    def submit(self, requests: list[tuple[str, list[int], SamplingParams]], sink: Sink) -> None:
        """Queue engine requests that share one sink; all or none (a refused one aborts the rest)."""
        added: list[str] = []
        try:
            for request_id, prompt_ids, params in requests:
                self._sinks[request_id] = sink
                self.engine.add_request(prompt_ids, params, request_id=request_id)
                added.append(request_id)
                self.inflight += 1
        except Exception:
            for request_id, _, _ in requests:
                if request_id not in added:
                    self._sinks.pop(request_id, None)
            for request_id in added:
                self.engine.abort(request_id, "a sibling request was refused")
            raise
        finally:
            self._wake.set()

    def abort(self, request_id: str, detail: str) -> bool:
        found = self.engine.abort(request_id, detail)
        self._wake.set()
        return found

    def abort_all(self, detail: str) -> None:
        """Abort every request in flight (from any thread): each ends with reason `abort` at the next step."""
        for request_id in list(self.engine.seqs):
            self.engine.abort(request_id, detail)
        self._wake.set()

    def end_unfinished(self, reason: str, detail: str) -> int:
        """Finish at once every request whose handler still waits for outputs, with `reason` and
        no further tokens: for when the engine thread cannot be waited for (a step failed, the
        process is exiting). Safe from any thread: a request's sink is taken once, here or by
        the engine thread's own finished output, never both. Returns how many were ended."""
        ended = 0
        for request_id in list(self._sinks):
            sink = self._sinks.pop(request_id, None)
            if sink is None or self._aloop is None:
                continue
            out = RequestOutput(request_id, None, [], [], finished=True, finish_reason=reason, finish_detail=detail)
            self._aloop.call_soon_threadsafe(self._deliver, sink, out)
            ended += 1
        return ended

    def _deliver(self, sink: Sink, out: RequestOutput) -> None:
        if out.finished:
            self.inflight -= 1
        sink(out)

    # ---- operator controls (any thread) --------------------------------------------------
    def drain(self, timeout_s: float | None = None, abort_after: bool = False) -> dict:
        self.engine.drain(timeout_s, abort_after)
        self._wake.set()
        return self.drain_status()

    def resume(self) -> dict:
        self.engine.resume()
        self._wake.set()
        return self.drain_status()

    def drain_status(self) -> dict:
        drain = self.engine.drain_state.as_dict()
        return {"state": self.engine.state.value, "in_flight": len(self.engine.seqs), "drain": drain}

    def evict_sequence(self, request_id: str, requeue: bool) -> bool:
        found = self.engine.evict_sequence(request_id, requeue=requeue)
        self._wake.set()
        return found

    async def until_evicted(self, request_id: str, wait_s: float) -> bool:
        """Wait, without holding the event loop, until the engine thread has applied a queued
        eviction of `request_id` (it does at its next step); False if it is still queued after
        `wait_s` seconds or the engine thread is gone."""
        deadline = time.monotonic() + wait_s
        while self.engine.eviction_queued(request_id):
            if time.monotonic() >= deadline or not self.running:
                return False
            await asyncio.sleep(EVICT_POLL_S)
        return True

    def evict_prefix_cache(self, max_blocks: int | None = None) -> int:
        dropped = self.engine.evict_prefix_cache(max_blocks)
        if threading.current_thread() is not self._thread:
            # spilling to the CPU tier copies KV here, off the engine thread: an OpenMP pool of this
            # thread's would make the engine's team spin-starved again (engine/runtime/openmp.py)
            release_thread_pool()
        return dropped

    def note_rejected(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        if reason == "queue_full":
            self.triggers.note_queue_full(detail)

    # ---- frames and snapshots ------------------------------------------------------------
    def frame(self) -> dict:
        """A stats frame (DESIGN §6) plus what the server knows: queue, drain, snapshots."""
        f = self.engine.stats()
        f["server"] = {
            "pid": _pid(),
            "addresses": dict(self.addresses),
            "in_flight": self.inflight,
            "max_queue": self.config.max_queue,
            "rejected": dict(self.rejected),
            "finish_reasons": dict(self.finish_reasons),
            "drain": self.engine.drain_state.as_dict(),
            "snapshots": list(self.snapshots[-RECENT_SNAPSHOTS:]),
            "stats_interval_s": self.config.stats_interval,
            "history_s": self.config.history,
        }
        return f

    def gauges(self) -> dict:
        """What a /metrics scrape reads: the engine's counters and gauges (`LLMEngine.gauges`, no
        per-sequence rows, block map or percentiles) and the server's counts."""
        g = self.engine.gauges()
        g["server"] = {"in_flight": self.inflight, "rejected": dict(self.rejected),
                       "finish_reasons": dict(self.finish_reasons)}  # fmt: skip
        return g

    def default_snapshot_path(self, reason: str) -> Path:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in reason)[:40]
        return self.config.snapshot_dir / f"kvtop-{stamp}-{safe}.kvsnap"

    def snapshot(
        self, path: str | Path | None = None, reason: str = "manual", name: str | None = None, force: bool = False
    ) -> Path:
        """Write the flight recorder, events, sequences and block table to a `.kvsnap` file
        (`path`, or a fresh file named after `name` or the reason in the snapshot dir). A bad
        `path` raises SnapshotError before anything is logged or written."""
        target = check_target(path, force=force) if path else self.default_snapshot_path(name or reason)
        fresh = not path or target.is_dir()  # a name of our own: never collides, never replaces
        if target.is_dir():
            target = target / self.default_snapshot_path(name or reason).name
        with self._snapshot_lock:
            taken = self.engine.metrics.event("snapshot", None, f"{reason}: {target}")
            try:
                written = self._write_snapshot(target, reason, force, fresh)
            except BaseException:
                with contextlib.suppress(ValueError):  # a snapshot that was not written was not taken
                    self.engine.metrics.events.remove(taken)
                raise
            self.snapshots.append({"ts": time.time(), "path": str(written), "reason": reason})
            self.snapshot_counts[reason.split(":")[0]] += 1
        return written

    def _write_snapshot(self, target: Path, reason: str, force: bool, fresh: bool) -> Path:
        """The snapshot at `target`, its own event already in the ring it copies."""
        frames = [*self.recorder.snapshot_frames(), self.frame()]
        return write_snapshot(
            target,
            model=self.engine.config.served_model_name or self.engine.config.model,
            config={"engine": asdict(self.engine.config), "server": asdict(self.config)},
            reason=reason,
            frames=frames,
            events=list(self.engine.metrics.events),
            force=force,
            fresh=fresh,
            trace=self.engine.trace_tables(),
        )

    def _auto_snapshot(self, trigger: str, detail: str) -> None:
        try:
            path = self.snapshot(reason=f"{trigger}: {detail}", name=trigger)
            log(f"snapshot ({trigger}: {detail}) written to {path}")
        except Exception as exc:  # a full disk must not take the engine down
            log(f"automatic snapshot ({trigger}) failed: {exc}")

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        interval = self.config.stats_interval
        next_frame = time.time() + interval
        while not self._stop.is_set():
            worked = False
            if self.engine.has_pending():
                before = self.engine.step_count
                try:
                    outputs = self.engine.step()
                except Exception:
                    self._crashed(traceback.format_exc())
                    outputs = []
                self._dispatch(outputs)
                worked = bool(outputs) or self.engine.step_count != before
            now = time.time()
            self._check_drain(now)
            if now >= next_frame:
                self._record(now)
                next_frame = now + interval
            if not worked:
                self._wake.wait(timeout=max(0.0, min(next_frame - time.time(), interval)))
                self._wake.clear()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        aloop = self._aloop
        for out in outputs:
            if out.finished:
                self.finish_reasons[out.finish_reason or "unknown"] += 1
                sink = self._sinks.pop(out.request_id, None)
            else:
                sink = self._sinks.get(out.request_id)
            if sink is not None and aloop is not None and not aloop.is_closed():
                aloop.call_soon_threadsafe(self._deliver, sink, out)

    def _check_drain(self, now: float) -> None:
        if self.engine.state is not EngineState.DRAINING:
            return
        if not self.engine.has_unfinished():
            self.engine.drain()  # marks it drained (a step that only aborted does not)
            return
        drain = self.engine.drain_state
        if drain.deadline_passed(now):
            ids = list(self.engine.seqs)
            for request_id in ids:
                self.engine.abort(request_id, f"drain timeout ({drain.info.timeout_s:g} s)")
            drain.note_aborted(len(ids))  # once

    def _record(self, now: float) -> None:
        try:
            frame = self.frame()
        except Exception:
            log(f"stats frame failed:\n{traceback.format_exc()}")
            return
        self.recorder.record(frame)
        for firing in self.triggers.check(frame):
            threading.Thread(
                target=self._auto_snapshot, args=(firing.trigger, firing.detail), name="kvtop-snapshot", daemon=True
            ).start()

    def _crashed(self, tb: str) -> None:
        """A step raised: fail every request in flight with reason `error`, keep serving."""
        log(f"engine step failed; aborting the requests in flight:\n{tb}")
        self.abort_all("engine error")
        self.end_unfinished("error", "engine error")


def _pid() -> int:
    import os

    return os.getpid()
