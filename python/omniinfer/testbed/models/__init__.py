"""The test bed's models: the embedded default (SmolLM2-135M), its MoE form, tiny test models."""
