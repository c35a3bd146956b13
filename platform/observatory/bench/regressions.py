"""`python -m observatory.bench.regressions` (as `make bench` runs it): the regression runs' benchmark, which lives
in regressions.bench."""
from regressions.bench import main

if __name__ == "__main__":
    main()
