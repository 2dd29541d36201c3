"""Benchmarks that reproduce every figure in BENCHMARKS.md (`make bench` runs `python -m bench.run_all`)."""
