"""State-space (Mamba-2) layers and the hybrid Mamba / attention stack, in plain PyTorch."""
