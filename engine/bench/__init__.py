"""Benchmarks of the engine components; each prints its figures as ``BENCH <name>=<value> <unit>`` lines."""
