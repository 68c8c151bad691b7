"""Checkpoints: tensor names, the safetensors loader, the hub download, the tiny-model generator and the public
reference models to compare with (``references``)."""
