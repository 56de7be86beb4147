from django.db import migrations, models
from django.utils import timezone

USED_AT = models.DateTimeField(
    blank=True,
    help_text="The name's last grant (or its registration), by the database's clock: "
    "how long it has been idle.",
    null=True,
)


def used_now(apps, schema_editor):
    """Names known before the sweep of idle names existed count as used now: a sweep
    keeps them for its idle time at least."""
    now = timezone.now()
    for model in ("SessionFence", "RowFence"):
        fences = apps.get_model("djlocks", model).objects.using(schema_editor.connection.alias)
        fences.filter(used_at=None).update(used_at=now)


class Migration(migrations.Migration):
    dependencies = [
        ("djlocks", "0007_lease_hand_over"),
    ]

    operations = [
        migrations.AddField(model_name="rowfence", name="used_at", field=USED_AT),
        migrations.AddField(model_name="sessionfence", name="used_at", field=USED_AT),
        migrations.RunPython(used_now, migrations.RunPython.noop),
    ]
