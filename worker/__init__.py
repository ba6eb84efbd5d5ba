"""Workers: the PSClient library and the PyTorch integration."""
