"""Kernel variants the engine does not run (moved out of dustin/kernels/): importable, tested where cheap
(tests/test_select_radix.py), and timed by scripts/gpu_tune.py and
scripts/gpu_kernel_variants.py.

- select_radix.py: Dustin's selection in three launches without torch.topk (slower on an H200);
Moved into the engine (git keeps the experiment): sparse verify whose splits merge inside the one launch
(`sparse_verify_attention(merge=True)`) and the self-zeroing int32 buffers (dustin/kernels/arrival.py).
Deleted instead (strictly slower, git keeps them): the score estimation's separate combine launch
(`attention_scores(fused=False)`) and its two-pass path that re-read K in pass 2 (`single_pass=False`).
"""
