"""For uvicorn: ``uvicorn tests.worker_models.asgi:application``."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.worker_models.settings")
application = get_asgi_application()
