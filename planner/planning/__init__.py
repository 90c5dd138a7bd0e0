"""Optimizers and baselines: profile and cluster to Plan."""
