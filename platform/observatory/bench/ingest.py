"""Forwards to `python -m ingest.bench` (this module path is kept for scripts that name it)."""
from ingest.bench import main

if __name__ == "__main__":
    main()
