"""Offline profiling of a target-draft pair (paper Sec. 3.1, 4.2.1-4.2.2, Algorithm 1, appendix I).

    srh     needle-in-a-haystack trials -> per-(layer, head) retrieval scores -> top heads per layer (SRHs)
    trace   teacher-forced classic-SD steps on real long texts -> per-layer score rows over the SRHs
    search  Algorithm 1 on the stored rows (never re-runs the models) -> a tuned `SparseConfig`

Each stage writes into one output folder and skips the work already there (resumable); `dustin profile`
drives them (docs/profiling.md).
"""
