"""python: a launch script for the project's own runtime, target ``shardplan`` (``export.py``), read back
by ``read.py``; the runtime names it imports in ``keys.py``.
"""
