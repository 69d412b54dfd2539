"""tierd benchmarks: every figure measured beside its physical limit in the same run."""
