"""Entry point of ``python -m engine.replica``."""
import sys

from engine.replica.cli import main

sys.exit(main())
