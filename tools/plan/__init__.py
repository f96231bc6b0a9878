"""Full-size memory plan without the hardware: ``python -m tools.plan``.

Builds the target and its EAGLE-3 draft abstractly (shapes, dtypes and mesh shardings; no weights),
lowers and compiles the serving programs on fake CPU devices, and prints per device what the
parameters, the caches and the compiled programs' temporaries need, and whether that fits a given
HBM size. See ``serve.py`` for what is measured and what is computed, ``train.py`` for the draft
training step and ``report.py`` for the printed tables.
"""
