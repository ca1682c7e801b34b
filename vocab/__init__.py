"""The words every layer shares: the error type, file I/O, the plan vocabulary and the plan document.

Imports nothing of the project (only the standard library, pydantic, yaml and numpy), so that
``profiler``, ``costmodel``, ``solvers``, ``runtime`` and ``planner`` can all build on it.
"""
