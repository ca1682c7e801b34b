"""Wires the pipeline (model → profile → cost model → solvers → plan) and owns the CLI.

Importing ``planner`` is light: the plan schema and the CLI import heavy packages lazily.
"""
