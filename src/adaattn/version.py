"""The package version, importable without the rest of adaattn."""

__version__ = "0.1.0"
