"""Multi-GPU execution: tensor parallelism of the target (tp.py) and TP-aware sparse selection (tp_selection.py)."""
