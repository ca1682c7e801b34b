"""nanotron: a YAML config (``export.py``), read back by ``read.py``; key names in ``keys.py``.
"""
