"""The stats/control socket from the client side: where it is, whether to trust it, and an httpx
client over it.

Path: `--socket`, else `KVTOP_SOCKET`, else `${XDG_RUNTIME_DIR:-/tmp}/kvtop-$UID/engine.sock`.

Trust: a control is sent only to the engine of the user expected — this user, or the one
`KVTOP_SOCKET_OWNER` names (a user name or uid: root steering a service account's engine). The
socket's directory and the socket file must belong to that user, and so must the process that
listens on it (SO_PEERCRED, checked on every new connection before a byte is sent). Anything else
is `SocketNotTrusted`: one line naming the path, the owner found and the owner expected.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path

import httpcore
import httpx

from kvtop.protocol.config import EVICT_WAIT_S
from kvtop.protocol.frame import StatsFrame
from kvtop.protocol.sockets import default_socket_path, describe_uid, peer_uid, resolve_socket

__all__ = [
    "EngineClient",
    "EngineRequestError",
    "EngineUnavailable",
    "SocketNotTrusted",
    "check_socket_owner",
    "default_socket_path",
    "expected_owner",
    "resolve_socket",
]
OWNER_ENV = "KVTOP_SOCKET_OWNER"


class EngineUnavailable(Exception):
    """No engine answers at the socket path."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"no engine at {path} ({why}); start one with `kvctl serve` or pass --socket")
        self.path = path


class SocketNotTrusted(EngineUnavailable):
    """The socket, its directory or the process listening on it is not the expected user's:
    another local user may be standing in for the engine. Nothing was sent to it."""

    def __init__(self, path: Path, problem: str) -> None:
        Exception.__init__(self, f"not talking to the control socket {path}: {problem}")
        self.path = path


class EngineRequestError(Exception):
    """The engine answered with an error."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


def expected_owner(path: Path) -> int:
    """The uid whose engine the socket must be: `KVTOP_SOCKET_OWNER` (a name or a uid), else ours."""
    named = os.environ.get(OWNER_ENV, "").strip()
    if not named:
        return os.getuid()
    if named.isdigit():
        return int(named)
    try:
        return pwd.getpwnam(named).pw_uid
    except KeyError:
        raise SocketNotTrusted(path, f"{OWNER_ENV}={named} names no user here: give a user name or a uid") from None


def _mismatch(what: str, found: int, expected: int) -> str:
    return (
        f"{what} {describe_uid(found)}, not {describe_uid(expected)} whose engine is expected "
        f"(another local user may be standing in for it; {OWNER_ENV} names the user to trust)"
    )


def check_socket_owner(path: Path, expected: int) -> bool:
    """Whether there is a socket file at `path` (False: nothing there); SocketNotTrusted when it,
    or the directory it is in (after symlinks), is not `expected`'s. A cheap first look, with
    clear words: `_PeerChecked` is the proof."""
    real = Path(os.path.realpath(path))
    try:
        st = real.lstat()
        directory = real.parent.stat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise EngineUnavailable(path, exc.strerror or type(exc).__name__) from None
    if directory.st_uid != expected:
        raise SocketNotTrusted(path, _mismatch(f"its directory {real.parent} belongs to", directory.st_uid, expected))
    if not stat.S_ISSOCK(st.st_mode):
        raise EngineUnavailable(path, "not a socket")
    if st.st_uid != expected:
        raise SocketNotTrusted(path, _mismatch("it belongs to", st.st_uid, expected))
    return True


class _PeerChecked(httpcore.SyncBackend):
    """httpcore's network backend, refusing a Unix-socket connection whose listening process is
    not the expected user's before anything is sent on it (SO_PEERCRED: a file swapped in after
    `check_socket_owner` looked cannot fake it)."""

    def __init__(self, path: Path, expected: int) -> None:
        self.path, self.expected = path, expected

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options=None):
        stream = super().connect_unix_socket(path, timeout=timeout, socket_options=socket_options)
        uid = peer_uid(stream.get_extra_info("socket"))
        if uid is not None and uid != self.expected:
            stream.close()
            raise SocketNotTrusted(self.path, _mismatch("the process listening on it runs as", uid, self.expected))
        return stream


class _TrustedUnixTransport(httpx.HTTPTransport):
    """httpx's transport over the control socket, every new connection checked by `_PeerChecked`.
    httpx takes no network backend, so its connection pool is rebuilt with one (httpcore's public
    ConnectionPool; `_pool` is the one name of httpx's this relies on, and tests/test_local_trust.py
    fails if a change of httpx ever bypasses it)."""

    def __init__(self, path: Path, expected: int) -> None:
        super().__init__(uds=str(path))
        self._pool = httpcore.ConnectionPool(
            uds=str(path),
            network_backend=_PeerChecked(path, expected),
            max_connections=100,  # httpx's default limits, as HTTPTransport gives its own pool
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
        )


class EngineClient:
    """Blocking client of the control socket (kvctl, kvtop's worker threads, tests). It talks only
    to the expected user's engine (module docstring); `owner` overrides KVTOP_SOCKET_OWNER."""

    def __init__(self, socket: str | Path | None = None, timeout: float = 10.0, owner: int | None = None) -> None:
        self.path = resolve_socket(socket)
        self.owner = expected_owner(self.path) if owner is None else owner
        self.timeout = timeout
        self._http = httpx.Client(
            transport=_TrustedUnixTransport(self.path, self.owner), base_url="http://kvtop", timeout=timeout
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self) -> None:
        if not check_socket_owner(self.path, self.owner):
            raise EngineUnavailable(self.path, "no socket")

    def _request(self, method: str, url: str, **kw) -> dict:
        self._check()
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

    def stats(self) -> StatsFrame:
        return self._request("GET", "/v1/stats")  # type: ignore[return-value]  # the engine built it from the types

    def history(self, since: float | None = None) -> dict:
        """The flight recorder's frames (only those after `since`, a frame ts, when given)."""
        return self._request("GET", "/v1/history", params={} if since is None else {"since": since})

    def drain(self, timeout_s: float | None = None, abort_after: bool = False) -> dict:
        return self._request("POST", "/v1/drain", json={"timeout_s": timeout_s, "abort_after": abort_after})

    def resume(self) -> dict:
        return self._request("POST", "/v1/resume")

    def evict(self, **body) -> dict:
        """A sequence's eviction answers once the engine applied it (`applied`), or after `wait_s`
        (202, `applied` false): the request's own timeout allows for that wait."""
        wait = body.get("wait_s", EVICT_WAIT_S) if body.get("seq_id") is not None else 0.0
        return self._request("POST", "/v1/evict", json=body, timeout=self.timeout + wait)

    def snapshot(self, path: str | None = None, reason: str = "manual", force: bool = False) -> dict:
        """Ask for a snapshot at `path` (the server's snapshot dir when None). An existing file
        is refused (409) unless `force`, and even then only a regular file is replaced."""
        body = {"path": path, "reason": reason, **({"force": True} if force else {})}
        return self._request("POST", "/v1/snapshot", json=body)

    def stream(self, interval: float = 0.5) -> Iterator[dict]:
        """Frames as the engine pushes them (one JSON object per line)."""
        self._check()
        try:
            with self._http.stream("GET", "/v1/stats/stream", params={"interval": interval}, timeout=None) as r:
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise EngineUnavailable(self.path, type(exc).__name__) from None
