"""Forwards to `python -m traces.bench` (this module path is kept for scripts that name it)."""
from traces.bench import main

if __name__ == "__main__":
    main()
