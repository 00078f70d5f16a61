"""Planning a run before any model loads: batch math, memory, hardware, DeepSpeed configs, the world. No torch at import."""
