"""For gunicorn: ``gunicorn tests.worker_models.wsgi``."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.worker_models.settings")
application = get_wsgi_application()
