"""Benchmarks (`make bench`): each figure is printed as `BENCH <name>=<value> <unit>`."""
