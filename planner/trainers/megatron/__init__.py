"""Megatron-LM: the flags of ``pretrain_gpt.py`` (``export.py``), read back by ``read.py``; key names in
``keys.py``.
"""
