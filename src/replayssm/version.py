"""The package version (one definition; ``replayssm.__version__`` reads it)."""

__version__ = "0.1.0"
