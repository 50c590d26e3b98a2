"""Benchmarks of hostpool_nb against the implementations it replaces.

Run ``python -m bench`` from the repository root.
"""
