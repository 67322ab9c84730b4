"""What the engine and its tools share, and nothing else: the stats frame's types and their schema
check (`frame`, `frame_schema`), the `.kvsnap` format, its reader and writer (`snapshot_format`,
`snapshot_reader`, `snapshot`), the Prometheus metric names (`metric_names`), where the control
socket is and who stands behind it (`sockets`), the engine's and the server's knobs that kvctl
declares as flags (`config`), the errors both raise (`errors`), the cache directory (`paths`) and
the version.

Torch-free, and it imports nothing outside the standard library but sqlite-utils (to write a
snapshot): the light install (`pip install kvtop`) is the tools over this package; the engine
(`pip install "kvtop[engine]"`) imports it too, and nothing here imports the engine or the rest of
`kvtop` (tests/test_architecture.py).

Why under `kvtop/` and not a top-level package: the light wheel is the `kvtop` distribution, whose
import root is `kvtop`; the protocol ships in it without a second top-level name in site-packages,
and is versioned with the tools that read it. `kvtop/__init__.py` is kept light so that the engine
importing `kvtop.protocol` pulls in no dashboard, CLI or httpx.
"""
