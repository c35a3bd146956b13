"""Background jobs kept in the metadata database (regression runs, tuning studies, rollouts): leases and
heartbeats, enqueueing by task name, and the base of their management commands."""
