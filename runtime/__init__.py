"""Runtime that carries out a pipeline plan (in one process or under torchrun); filled in later issues."""
