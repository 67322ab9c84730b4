"""The OpenAI-compatible app on the TCP port: completions, chat, models, health, metrics.

Each HTTP request becomes one engine request per prompt × `n` (a `Job`, jobs.py), sharing one
asyncio queue that the engine thread feeds (loop.py). A client that goes away aborts its engine
requests, so their KV blocks are freed at the next step; a full queue or a draining engine
answers at once. The API key is checked on each request's head by the connection's protocol
(app.py), before any route or body, on every path but PUBLIC_PATHS. `/openapi.json` describes
it all (openapi.py). Routes live one API per module; what they share is in serving.py and
streaming.py, and every error leaves through errors.py.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI

from engine.server.errors import install_error_handlers
from engine.server.loop import EngineLoop
from engine.server.openapi import install_openapi
from engine.server.routes_chat import chat_router
from engine.server.routes_completions import completions_router
from engine.server.routes_models import health_router, models_router
from engine.server.serving import Serving
from kvtop.protocol.version import __version__

# no API key on these, as vLLM: probes, scrapers and schema readers do not carry one
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def build_api(loop: EngineLoop, registry) -> FastAPI:
    s = Serving(loop, getattr(registry, "requests", None))
    app = FastAPI(title="kvtop", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app)
    install_openapi(app, __version__, s.served)
    v1 = APIRouter(prefix="/v1")
    for router in (completions_router(s), chat_router(s), models_router(s)):
        v1.include_router(router)
    app.include_router(v1)
    app.include_router(health_router(s, registry))
    return app
