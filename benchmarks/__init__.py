"""The benchmarks behind docs/results.md, run as `python -m benchmarks.NAME` or `specdistill bench NAME` (README.md)."""
