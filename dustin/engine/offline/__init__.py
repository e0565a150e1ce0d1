"""Offline batches over the engine core: how a batch gets its core (batch.py) and the prompt caches of benchmark and
evaluation batches made by copying or by noise instead of by a prefill (prefill.py)."""
