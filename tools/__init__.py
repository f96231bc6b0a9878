"""Command-line tools that sit beside the eagle3_jax library (run as ``python -m tools.<name>``)."""
