"""Slurm fixtures (being written)."""
