"""Helpers for testing megatron-opd: spawning gloo ranks and building tiny models."""
