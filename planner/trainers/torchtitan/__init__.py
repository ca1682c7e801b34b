"""torchtitan: a job config TOML (``export.py``), read back by ``read.py``; key names in ``keys.py``.
"""
