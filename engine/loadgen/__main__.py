"""``python -m engine.loadgen``: see ``engine.loadgen.cli``."""
import sys

from engine.loadgen.cli import main

sys.exit(main())
