"""Binding the control socket and the TCP port safely. Where the socket lives, and how a client
knows who stands behind it, is the protocol's (kvtop/protocol/sockets.py), shared with the tools.

The socket is bound by us rather than by uvicorn, which would make it 0666: it is created 0600
(umask while binding) in a directory we create 0700. The directory is the trust anchor: whoever can
write in it can replace the socket and stand in for the engine, so an existing one that another
user owns, or that is open to group or others, is refused (before the model loads) rather than
used or tightened. A socket file nobody answers on is stale (an engine of ours that died) and is
replaced; one that answers means another engine owns it; one another user owns is not touched.
Clients check the same from their side (`kvtop.client`), and the listening process's uid too
(`peer_uid`), which a swapped file cannot fake.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from pathlib import Path

from engine.errors import ServeError
from kvtop.protocol.sockets import describe_uid

UDS_PATH_MAX = 107  # sun_path is 108 bytes on Linux, NUL included


def check_socket_dir(directory: Path) -> None:
    """Fail unless `directory` is a directory that only this process's user can enter and write:
    owned by us, no group or other bits. Another user's directory (made first at the default path,
    say) would let that user replace the socket and stand in for the engine."""
    try:
        link = directory.lstat()
        st = directory.stat()
    except OSError as exc:
        raise ServeError(f"cannot use the socket directory {directory}: {exc.strerror}") from None
    me = os.getuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
        raise ServeError(
            f"the socket directory {directory} is a symbolic link of {describe_uid(link.st_uid)}'s, not yours "
            f"({describe_uid(me)}): remove it or pass another --socket"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ServeError(f"{directory} is not a directory: pass --socket with a path in a directory")
    if st.st_uid != me:
        raise ServeError(
            f"the socket directory {directory} belongs to {describe_uid(st.st_uid)}, not to you ({describe_uid(me)}): "
            "that user could stand in for the engine; remove it or pass --socket in a directory of yours"
        )
    if st.st_mode & 0o077:
        raise ServeError(
            f"the socket directory {directory} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"`chmod 700 {directory}`, remove it, or pass --socket in a directory only you can open (0700)"
        )


def _prepare_dir(directory: Path) -> None:
    """Create `directory` 0700, or check the one that is there (another user may have made it first)."""
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ServeError(f"cannot create the socket directory {directory}: {exc.strerror}") from None
    else:
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
    check_socket_dir(directory)


def check_socket_path(path: Path) -> None:
    """Fail if `path` can never be bound: longer than sun_path holds."""
    size = len(os.fsencode(str(path)))
    if size > UDS_PATH_MAX:
        raise ServeError(
            f"socket path {path} is {size} bytes, longer than the {UDS_PATH_MAX} a Unix socket allows: "
            "pass a shorter --socket"
        )


def check_socket(path: Path) -> None:
    """Fail if `path` cannot be a socket of ours: its directory exists and is not ours alone, a
    file there is not a socket or is another user's, or another engine answers there; remove a
    stale socket file. Called before the model loads, so a bad --socket fails in a moment."""
    check_socket_path(path)
    if os.path.lexists(path.parent):
        check_socket_dir(path.parent)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ServeError(f"cannot use the socket path {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ServeError(f"{path} exists and is not a socket: remove it or pass another --socket")
    if st.st_uid != os.getuid():  # not probed, not replaced: it is not ours to judge
        raise ServeError(
            f"the socket {path} belongs to {describe_uid(st.st_uid)}, not to you ({describe_uid(os.getuid())}): "
            "remove it or pass another --socket"
        )
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
    """A listening Unix socket at `path`, mode 0600, in a 0700 directory of ours."""
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
