"""DeepSpeed: a config JSON (``export.py``), read back by ``read.py``; key names in ``keys.py``.
"""
