"""Forwards to `python -m ingest.overload_bench` (this module path is kept for scripts that name it)."""
from ingest.overload_bench import main

if __name__ == "__main__":
    main()
