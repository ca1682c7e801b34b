"""CLI commands of the later pipeline stages, one module each, registered on ``planner.cli.app``.

Every module in this package is imported by :func:`planner.cli.main`; a module registers its
commands with ``@app.command()`` and keeps heavy imports inside the command bodies.
"""

import importlib
import pkgutil

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")
