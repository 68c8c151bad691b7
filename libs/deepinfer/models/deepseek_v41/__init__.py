"""DeepSeek-V4.1(-Flash): config, layer typing, the model (text backbone, Engram, DSpark drafter, vision tower),
its decode steps and CUDA graphs."""
