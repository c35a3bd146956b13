"""Forwards to `python -m apikit.bench` (this module path is kept for scripts that name it)."""
from apikit.bench import main

if __name__ == "__main__":
    main()
