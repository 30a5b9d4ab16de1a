"""Hydra structured configs and the builders that turn a composed config into run objects."""
