"""The published-run harness: published training runs as cost-model inputs (``runs.py``), the cost
model validated against them (``validate.py``, ``shardplan validate``) and the few cost constants
fitted to them (``fit.py``, ``shardplan fit``). A user's own runs are :mod:`costmodel.calibration`'s.
"""
