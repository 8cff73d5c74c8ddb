"""KV-cache block manager: the block pool, per-request block tables, and the step API the scheduler calls."""
