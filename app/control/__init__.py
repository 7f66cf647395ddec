"""SARA controller logic: observe, predict, size and plan pool changes (Ray-free)."""
