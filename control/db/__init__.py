"""The controlplane's database: the `Database` interface its tables' owners use (`base`), the
SQLite and PostgreSQL backends, and `open_database`, which picks one from the settings."""
