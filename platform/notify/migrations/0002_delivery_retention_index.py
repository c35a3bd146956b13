# The index the retention task (notify.prune_deliveries) finds old finished deliveries through.

from django.db import migrations, models


class AddIndexConcurrentlyOnPostgres(migrations.AddIndex):
    """CREATE INDEX CONCURRENTLY on PostgreSQL, so a large delivery table keeps taking writes (alert transitions,
    delivery results) while the index builds; a plain CREATE INDEX elsewhere."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            if schema_editor.connection.vendor == "postgresql":
                schema_editor.add_index(model, self.index, concurrently=True)
            else:
                schema_editor.add_index(model, self.index)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            index = from_state.models[app_label, self.model_name_lower].get_index_by_name(self.index.name)
            if schema_editor.connection.vendor == "postgresql":
                schema_editor.remove_index(model, index, concurrently=True)
            else:
                schema_editor.remove_index(model, index)


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ('notify', '0001_initial'),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name='delivery',
            index=models.Index(fields=['status', 'updated_at'], name='notify_finished_idx'),
        ),
    ]
