"""The worker: one batch of KV-cache rows on the device and the speculative step over it (docs/architecture.md).

runner.py (`Runner`, what the executor calls), batch.py (`BatchState`, every row's state; the `StepState` policies
read), prefill.py (prompts into the caches), step.py (`DeviceStep`, the capturable step and its CUDA graphs),
staging.py (steps in flight read back), costs.py (the step times behind `--gamma auto`).
"""
