"""The stats/control socket from the client side: where it is, and an httpx client over it.

Path: `--socket`, else `KVTOP_SOCKET`, else `${XDG_RUNTIME_DIR:-/tmp}/kvtop-$UID/engine.sock`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx

from engine.server.sockets import default_socket_path, resolve_socket

__all__ = ["EngineClient", "EngineRequestError", "EngineUnavailable", "default_socket_path", "resolve_socket"]


class EngineUnavailable(Exception):
    """No engine answers at the socket path."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"no engine at {path} ({why}); start one with `kvctl serve` or pass --socket")
        self.path = path


class EngineRequestError(Exception):
    """The engine answered with an error."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


class EngineClient:
    """Blocking client of the control socket (kvctl, kvtop's worker threads, tests)."""

    def __init__(self, socket: str | Path | None = None, timeout: float = 10.0) -> None:
        self.path = resolve_socket(socket)
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.path)), base_url="http://kvtop", timeout=timeout
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, url: str, **kw) -> dict:
        if not self.path.exists():
            raise EngineUnavailable(self.path, "no socket")
        try:
            r = self._http.request(method, url, **kw)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, OSError) as exc:
            raise EngineUnavailable(self.path, type(exc).__name__) from None
        except httpx.TimeoutException:
            raise EngineUnavailable(self.path, "timed out") from None
        try:
            body = r.json()
        except json.JSONDecodeError:
            body = {"error": {"message": r.text}}
        if r.status_code >= 400:
            msg = body.get("error", {}).get("message") if isinstance(body, dict) else str(body)
            raise EngineRequestError(msg or f"HTTP {r.status_code}", r.status_code)
        return body

    def healthz(self) -> dict:
        return self._request("GET", "/v1/healthz")

    def stats(self) -> dict:
        return self._request("GET", "/v1/stats")

    def history(self, since: float | None = None) -> dict:
        """The flight recorder's frames (only those after `since`, a frame ts, when given)."""
        return self._request("GET", "/v1/history", params={} if since is None else {"since": since})

    def drain(self, timeout_s: float | None = None, abort_after: bool = False) -> dict:
        return self._request("POST", "/v1/drain", json={"timeout_s": timeout_s, "abort_after": abort_after})

    def resume(self) -> dict:
        return self._request("POST", "/v1/resume")

    def evict(self, **body) -> dict:
        return self._request("POST", "/v1/evict", json=body)

    def snapshot(self, path: str | None = None, reason: str = "manual", force: bool = False) -> dict:
        """Ask for a snapshot at `path` (the server's snapshot dir when None). An existing file
        is refused (409) unless `force`, and even then only a regular file is replaced."""
        body = {"path": path, "reason": reason, **({"force": True} if force else {})}
        return self._request("POST", "/v1/snapshot", json=body)

    def stream(self, interval: float = 0.5) -> Iterator[dict]:
        """Frames as the engine pushes them (one JSON object per line)."""
        if not self.path.exists():
            raise EngineUnavailable(self.path, "no socket")
        try:
            with self._http.stream("GET", "/v1/stats/stream", params={"interval": interval}, timeout=None) as r:
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise EngineUnavailable(self.path, type(exc).__name__) from None
