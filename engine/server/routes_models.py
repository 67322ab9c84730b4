"""GET /v1/models (and /v1/models/{id}), /health and /metrics: what is served, whether it is up, its numbers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine.server.exposition import CONTENT_TYPE, render_metrics
from engine.server.openapi import HEALTH_DOC, MODEL_DOC, MODELS_DOC
from engine.server.serving import Serving


def models_router(s: Serving) -> APIRouter:
    router = APIRouter()
    engine = s.engine
    created = int(engine.start_time)

    def card() -> dict:
        return {
            "id": s.served,
            "object": "model",
            "created": created,
            "owned_by": "kvtop",
            "root": str(engine.model_path),
            "max_model_len": engine.max_seq_len,  # min(max_model_len, KV capacity): what a request can use
        }

    @router.get("/models", **MODELS_DOC)
    async def models():
        return {"object": "list", "data": [card()]}

    @router.get("/models/{model_id:path}", **MODEL_DOC)
    async def model(model_id: str):
        s.check_model(model_id)
        return card()

    return router


def health_router(s: Serving, registry) -> APIRouter:
    """No API key on these, as vLLM: probes and scrapers do not carry one."""
    router = APIRouter()

    async def health():
        state = s.engine.state.value
        ok = state == "running" and s.loop.running
        return JSONResponse({"status": "ok" if ok else state, "state": state}, status_code=200 if ok else 503)

    # one route per method: one route for both gave both the same OpenAPI operation id (a warning)
    router.get("/health", operation_id="health_health_get", **HEALTH_DOC)(health)
    router.head("/health", operation_id="health_health_head", **HEALTH_DOC)(health)

    @router.get("/metrics", response_class=PlainTextResponse)
    def metrics():  # sync: runs in the threadpool, a frame costs a little
        return Response(render_metrics(registry), media_type=CONTENT_TYPE)

    return router
