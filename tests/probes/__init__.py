"""Counts a test or benchmark reads off a run: bytes each process reads from safetensors files (``weight_reads``),
parameter elements all-gathered per step (``gather_count``), peak bytes of live tensors per step (``tensor_peak``).
Counts, not timings: the same run gives the same numbers. The benchmarks under ``bench/`` import them from here."""
