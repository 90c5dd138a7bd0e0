"""Schedules played out over time: Timeline from a plan's stages (pure)."""
