"""The URLs a user hands kvctl and kvtop (`--url`, `--base-url`, `--prometheus`, a `--targets`
file), checked once, up front: one that cannot be used is one line saying what is wrong with it,
not a traceback from deep inside httpx at the first poll."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

SCHEMES = ("http", "https")


def checked_url(text: str, option: str = "--url") -> str:
    """`text` as an http(s) URL a client can reach (`http://` added when it names no scheme, as
    `host:8000` means), or ValueError with one line naming `option` and what is wrong."""
    url = text.strip()
    if not url:
        raise ValueError(f"{option} is empty: give a URL such as http://127.0.0.1:8000")
    if "://" not in url:
        url = f"http://{url}"
    why = _problem(url)
    if why == "scheme":
        raise ValueError(f"{option} {text!r} is not an http(s) URL")
    if why:
        raise ValueError(f"{option} {text!r} is not a URL that can be reached: {why}")
    return url


def _problem(url: str) -> str | None:
    """What keeps `url` from being used ("scheme" for a scheme other than http(s)), or None."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL": a [ without its ]
        return "the [ of its IPv6 address is not closed" if "IPv6" in str(exc) else str(exc)
    if parts.scheme.lower() not in SCHEMES:
        return "scheme"
    if not parts.hostname:
        return "it names no host"
    port = parts.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")[2]
    if port and not port.isdigit():
        return f"the port {port!r} is not a number"
    if port and not 0 < int(port) < 65536:
        return f"the port {port} is not between 1 and 65535"
    try:
        httpx.URL(url)  # what the client will parse: anything else it refuses
    except httpx.InvalidURL as exc:
        return str(exc)
    return None
