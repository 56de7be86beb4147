from django.db import migrations, models

USED_AT = models.DateTimeField(
    blank=True,
    help_text="The name's last grant (or its registration), by the database's clock: "
    "how long it has been idle.",
    null=True,
)


class Migration(migrations.Migration):
    dependencies = [
        ("djlocks", "0007_lease_hand_over"),
    ]

    operations = [
        migrations.AddField(model_name="rowfence", name="used_at", field=USED_AT),
        migrations.AddField(model_name="sessionfence", name="used_at", field=USED_AT),
    ]
