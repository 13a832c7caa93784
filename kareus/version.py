"""kareus's version: what the profile store and plans key their records by."""

__version__ = "0.1.0"
