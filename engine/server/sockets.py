"""Where the control socket lives, and binding it and the TCP port safely.

Path (DESIGN §5): `--socket`, else `KVTOP_SOCKET`, else `${XDG_RUNTIME_DIR:-/tmp}/kvtop-$UID/engine.sock`.
The socket is bound by us rather than by uvicorn, which would make it 0666: it is created 0600
(umask while binding) in a directory we create 0700. A socket file nobody answers on is stale
(an engine that died) and is replaced; one that answers means another engine owns it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from pathlib import Path

from engine.server.config import ServeError

UDS_PATH_MAX = 107  # sun_path is 108 bytes on Linux, NUL included


def default_socket_path() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"kvtop-{os.getuid()}" / "engine.sock"


def resolve_socket(path: str | Path | None = None) -> Path:
    if path:
        return Path(path).expanduser()
    env = os.environ.get("KVTOP_SOCKET")
    return Path(env).expanduser() if env else default_socket_path()


def _is_default_dir(directory: Path) -> bool:
    return directory == default_socket_path().parent


def _prepare_dir(directory: Path) -> None:
    if not directory.exists():
        try:
            directory.mkdir(mode=0o700, parents=True)
        except OSError as exc:
            raise ServeError(f"cannot create the socket directory {directory}: {exc.strerror}") from None
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
    elif _is_default_dir(directory) and directory.stat().st_uid == os.getuid():
        os.chmod(directory, 0o700)
    if not directory.is_dir():
        raise ServeError(f"{directory} is not a directory: pass --socket with a path in a directory")


def check_socket_path(path: Path) -> None:
    """Fail if `path` can never be bound: longer than sun_path holds."""
    size = len(os.fsencode(str(path)))
    if size > UDS_PATH_MAX:
        raise ServeError(
            f"socket path {path} is {size} bytes, longer than the {UDS_PATH_MAX} a Unix socket allows: "
            "pass a shorter --socket"
        )


def check_socket(path: Path) -> None:
    """Fail if `path` cannot be a socket or another engine answers there; remove a stale socket
    file. Called before the model loads, so a bad --socket fails in a moment, not after it."""
    check_socket_path(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ServeError(f"cannot use the socket path {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ServeError(f"{path} exists and is not a socket: remove it or pass another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # stale: its engine is gone
        return
    except OSError as exc:
        raise ServeError(f"cannot check the socket {path}: {exc.strerror or exc}") from None
    finally:
        probe.close()
    raise ServeError(
        f"an engine is already listening at {path}: stop it (`kvctl drain`, then SIGTERM) or pass another --socket"
    )


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600, in a 0700 directory."""
    check_socket_path(path)
    _prepare_dir(path.parent)
    check_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot bind the socket {path}: {exc.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket; a busy port is a clear error, not a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ServeError(f"port {port} on {host} is in use: pass another --port (0 picks a free one)") from None
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock
