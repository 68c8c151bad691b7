"""Checkpoints: tensor names, the safetensors loader, the hub download and the tiny-model generator."""
