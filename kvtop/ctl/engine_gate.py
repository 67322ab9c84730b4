"""The one door from kvctl to the engine: the commands that run it (`serve`, `run`, `calibrate`,
`whatif`; `plan` for a .gguf file's shape) load its modules here, by name, when they run.

`pip install kvtop` is the light install — the dashboard and the commands that talk to an engine,
no torch — and the engine's modules ship in it without their dependencies. A command that needs
them says in one line what to install, and exits 1, instead of a traceback from an import deep in
the engine. Loading by name keeps every kvtop module importable without the engine (pandas'
`import_optional_dependency` does the same for its optional backends); the engine's modules are
the engine's, so what these commands call is typed there.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvtop.entry import CLIError

INSTALL = 'pip install "kvtop[engine]"'
NEEDS = ("torch",)  # imported first: some engine modules import it only inside the call


def load_engine(module: str, command: str) -> ModuleType:
    """The engine's module `module` (e.g. "engine.server.app"), for `kvctl command`; a CLIError
    naming what to install when the engine or one of its dependencies is not installed."""
    try:
        for name in NEEDS:
            importlib.import_module(name)
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing == "kvtop":  # our own module missing is a bug, not an install to suggest
            raise
        raise CLIError(
            f"kvctl {command} runs the engine, which is not installed here (no module {missing!r}): {INSTALL}"
        ) from None
