"""``python -m tools.doctor``: static checks of a target/draft pair, then the wiring that accepts most."""
