"""Models that ship with the project: the embedded default and the tiny test models."""
