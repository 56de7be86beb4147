from django.apps import AppConfig


class DjlocksConfig(AppConfig):
    name = "djlocks"
    verbose_name = "Locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from djlocks import checks  # noqa: F401  (registers the system checks)
