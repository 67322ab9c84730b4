"""Where the control socket lives and who stands behind it: the rule the engine binds by
(engine/server/sockets.py) and the tools connect by (kvtop/client.py), in one place.

Path (DESIGN §5): `--socket`, else `KVTOP_SOCKET`, else `${XDG_RUNTIME_DIR:-/tmp}/kvtop-$UID/engine.sock`.
Who: the kernel's word on the process listening (`peer_uid`, SO_PEERCRED), which a file swapped
in later cannot fake; both sides name a user the same way (`describe_uid`).
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
from pathlib import Path


def default_socket_path() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"kvtop-{os.getuid()}" / "engine.sock"


def resolve_socket(path: str | Path | None = None) -> Path:
    if path:
        return Path(path).expanduser()
    env = os.environ.get("KVTOP_SOCKET")
    return Path(env).expanduser() if env else default_socket_path()


def describe_uid(uid: int) -> str:
    """`uid 65534 (nobody)`: the number, and the name where the system has one."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a connected Unix socket, from the kernel
    (SO_PEERCRED: fixed when that process listened, so no file swapped in later can fake it);
    None where the platform has no such option."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid
