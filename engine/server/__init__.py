"""The serving side of the engine: an OpenAI-compatible HTTP API, Prometheus metrics, and the
stats/control socket (DESIGN §5), all in one process around one engine thread.

- `config.py` — ServerConfig: every server knob and its default.
- `loop.py` — EngineLoop: the thread that steps the engine, hands outputs to requests, keeps
  the flight recorder, runs drain deadlines and automatic snapshots.
- `api.py` / `protocol.py` / `detokenize.py` — the OpenAI routes, their request models and errors,
  streaming text.
- `control.py` — the control routes on the Unix socket.
- `metrics.py` — the Prometheus exposition (every metric name lives there).
- `triggers.py` — when to take an automatic snapshot.
- `sockets.py` — binding the TCP port and the Unix socket (permissions, stale sockets).
- `app.py` — wiring: two uvicorn servers in one event loop, signals, the startup summary.
"""
