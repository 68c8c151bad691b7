"""DeepSeek-V4.1(-Flash): config, layer typing, Engram hashing (model forward: not yet)."""
