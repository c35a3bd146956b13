"""`python -m observatory.bench.rollouts` (as `make bench` runs it): the rollouts' benchmark, which lives in
rollouts.bench."""
from rollouts.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
