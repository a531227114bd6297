"""The engine's pools and the prefix cache over them, each with one owner (the scheduler) and `check_integrity`."""
