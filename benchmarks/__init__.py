"""Comparison benchmark for custagg: `python -m benchmarks --help`."""
