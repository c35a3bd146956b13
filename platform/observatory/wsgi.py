"""WSGI entry point for server mode (gunicorn/uwsgi); embedded mode serves it with waitress from `runplatform`."""
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "observatory.settings")
application = get_wsgi_application()
