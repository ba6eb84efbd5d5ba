"""Server nodes and the resource manager (no torch)."""
