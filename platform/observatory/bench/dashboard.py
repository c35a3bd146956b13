"""Forwards to `python -m dashboards.bench` (this module path is kept for scripts that name it)."""
from dashboards.bench import main

if __name__ == "__main__":
    main()
