"""DeepSeek-V4 (V4-Flash, V4-Pro): config, model, inference state."""
