import contextlib
import sys

from django.apps import AppConfig


class DjlocksConfig(AppConfig):
    name = "djlocks"
    verbose_name = "Locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from djlocks import checks  # noqa: F401  (registers the system checks)

        if "celery" in sys.modules:  # a Celery worker imports Celery before Django's setup
            from djlocks.background import flush_in_celery_pool_processes

            with contextlib.suppress(ImportError):  # not Celery after all (a stub, a name)
                flush_in_celery_pool_processes()
