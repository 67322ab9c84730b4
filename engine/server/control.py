"""The control routes on the Unix socket (DESIGN §5): stats, the frame stream, history, drain,
resume, evict, snapshot, healthz. The socket's file mode is the access control (0600).

Bodies are small and read through engine.server.bodies (size, time, depth and surrogate limits),
so nothing a client sends ends in a 5xx. A snapshot path is checked before anything is logged or
written: a bad one is a 400 (409 for a file that exists without `force`) and leaves no trace."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from engine.server.bodies import read_request
from engine.server.errors import install_error_handlers
from engine.server.loop import EngineLoop
from engine.server.protocol import APIError, DrainRequest, EvictRequest, SnapshotRequest
from kvtop.protocol.snapshot import SnapshotError, SnapshotExists, check_target

MIN_INTERVAL, MAX_INTERVAL = 0.05, 60.0
MAX_CONTROL_BODY = 64 * 1024  # the largest real body is a snapshot path and a reason
READ_TIMEOUT = 10.0


class SnapshotBody(SnapshotRequest):
    force: bool = False  # replace an existing regular file at `path`


async def read_control(request: Request, model: type):
    return await read_request(request, model, MAX_CONTROL_BODY, READ_TIMEOUT)


def snapshot_refused(exc: SnapshotError) -> APIError:
    if isinstance(exc, SnapshotExists):
        return APIError(409, f"cannot write a snapshot: {exc}", param="path", code="file_exists")
    return APIError(400, f"cannot write a snapshot: {exc}", param="path", code="invalid_path")


def build_control(loop: EngineLoop, stopping: asyncio.Event) -> FastAPI:
    app = FastAPI(title="kvtop control", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.include_router(reading_router(loop, stopping))
    app.include_router(operator_router(loop))
    return app


def reading_router(loop: EngineLoop, stopping: asyncio.Event) -> APIRouter:
    """What the dashboard and `kvctl status` read: health, the frame, its stream, the history."""
    router = APIRouter(prefix="/v1")
    engine = loop.engine

    @router.get("/healthz")
    async def healthz():
        return {
            "status": "ok" if loop.running else "engine thread stopped",
            "state": engine.state.value,
            "model": engine.config.served_model_name or engine.config.model,
            "pid": os.getpid(),
            "uptime_s": time.time() - engine.start_time,
            **loop.addresses,
        }

    @router.get("/stats")
    def stats():
        return loop.frame()

    @router.get("/stats/stream")
    async def stats_stream(interval: float = 0.5):
        if not MIN_INTERVAL <= interval <= MAX_INTERVAL:
            raise APIError(400, f"interval must be between {MIN_INTERVAL} and {MAX_INTERVAL} seconds", param="interval")
        return StreamingResponse(frame_lines(loop, stopping, interval), media_type="application/x-ndjson")

    @router.get("/history")
    def history(since: float | None = None):
        frames = loop.recorder.snapshot_frames()
        events = list(engine.metrics.events)
        if since is not None:
            frames = [f for f in frames if f["ts"] > since]
            events = [e for e in events if e["ts"] > since]
        return {
            "interval_s": loop.recorder.interval_s,
            "history_s": loop.recorder.history_s,
            "frames": frames,
            "events": events,
        }

    return router


async def frame_lines(loop: EngineLoop, stopping: asyncio.Event, interval: float) -> AsyncIterator[str]:
    """One JSON frame a line every `interval` seconds, until the server stops."""
    while not stopping.is_set():
        t0 = time.monotonic()
        frame = await run_in_threadpool(loop.frame)
        yield json.dumps(frame, separators=(",", ":")) + "\n"
        try:
            await asyncio.wait_for(stopping.wait(), timeout=max(0.0, interval - (time.monotonic() - t0)))
        except asyncio.TimeoutError:
            pass


def operator_router(loop: EngineLoop) -> APIRouter:
    """What an operator does to the engine: drain, resume, evict, snapshot."""
    router = APIRouter(prefix="/v1")

    @router.post("/drain")
    async def drain(request: Request):
        req = await read_control(request, DrainRequest)
        return loop.drain(req.timeout_s, req.abort_after)

    @router.post("/resume")
    async def resume():
        return loop.resume()

    @router.post("/evict")
    async def evict(request: Request):
        req = await read_control(request, EvictRequest)
        result = evict_one(loop, req)
        if req.seq_id is None:  # cached blocks go at once
            return result
        applied = await loop.until_evicted(req.seq_id, req.wait_s)
        return JSONResponse({**result, "applied": applied}, status_code=200 if applied else 202)

    @router.post("/snapshot")
    async def snapshot(request: Request):
        return await write_snapshot(loop, await read_control(request, SnapshotBody))

    return router


def evict_one(loop: EngineLoop, req: EvictRequest) -> dict:
    chosen = [x for x in (req.seq_id is not None, req.prefix_cache, req.blocks is not None) if x]
    if len(chosen) != 1:
        raise APIError(400, "give exactly one of seq_id, prefix_cache: true, or blocks: N")
    if req.seq_id is not None:
        if not loop.evict_sequence(req.seq_id, req.requeue):
            raise APIError(404, f"no sequence {req.seq_id!r} in flight", param="seq_id", code="not_found")
        return {"evicted": "sequence", "seq_id": req.seq_id, "requeue": req.requeue}
    n = loop.evict_prefix_cache(None if req.prefix_cache else req.blocks)
    return {"evicted": "prefix_cache", "blocks": n}


async def write_snapshot(loop: EngineLoop, req: SnapshotBody) -> dict:
    try:
        if req.path is not None:
            check_target(req.path, force=req.force)  # before the event is logged: a bad path leaves no trace
        path = await run_in_threadpool(loop.snapshot, req.path, req.reason, None, req.force)
    except SnapshotError as exc:
        raise snapshot_refused(exc) from None
    except OSError as exc:
        where = req.path or str(loop.config.snapshot_dir)
        raise APIError(400, f"cannot write a snapshot to {where}: {exc.strerror or exc}", param="path") from None
    return {"path": str(Path(path))}
