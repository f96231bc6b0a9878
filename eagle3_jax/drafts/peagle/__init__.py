"""The P-EAGLE parallel draft (SpecForge ``PEagleDraftModel``)."""
