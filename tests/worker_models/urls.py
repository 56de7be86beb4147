"""``/hold`` (WSGI or ASGI, sync) and ``/hold-async`` (ASGI): see ``views``."""

from django.urls import path

from tests.worker_models.views import hold_async, hold_view

urlpatterns = [path("hold", hold_view), path("hold-async", hold_async)]
