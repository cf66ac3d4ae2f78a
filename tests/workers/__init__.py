"""Module-level functions run on pool ranks by the tests (they must be importable by spawned workers)."""
