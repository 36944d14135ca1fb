"""Synthetic tasks small enough to train and distil a model on a CPU (the quick start's data and models)."""
