"""`python -m observatory.bench.tuning` (as `make bench` runs it): the tuning studies' benchmark, which lives in
tuning.bench."""
from tuning.bench import main

if __name__ == "__main__":
    main()
