"""Framework adapters."""
