"""Ascend worker service: the worker contract on one Ascend NPU through torch_npu (not available yet)."""
