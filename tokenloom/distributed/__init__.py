"""Process groups and collectives; every collective is a no-op in a single process."""
