"""WSGI entry point: `runplatform` serves it (observatory/http_server.py); any WSGI server can too, without ingest."""
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "observatory.settings")
application = get_wsgi_application()
