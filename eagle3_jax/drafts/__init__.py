"""Draft kinds beyond the EAGLE-3 chain: one module per kind (config, module, name map, load/export)."""
