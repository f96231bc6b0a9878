"""Draft kinds: one package a kind (``eagle3``, ``peagle``)."""
