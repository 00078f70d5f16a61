"""Planning: what a run will get and what it needs, decided before any model loads. No torch at import."""
