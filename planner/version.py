"""The planner's version, written into every file it produces."""

__version__ = "0.1.0"
