"""Fused GPU kernels (Triton, import-guarded): see ``divergence_triton`` for the divergence losses."""
