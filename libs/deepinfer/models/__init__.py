"""Model definitions (plain PyTorch over the ops interface)."""
