"""``python -m engine.gateway``: run the OpenAI-compatible gateway."""
from engine.gateway.server import main

raise SystemExit(main())
