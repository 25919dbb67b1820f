"""The package version, in one place: ``setup.py`` reads this file as text (without importing
the package) and ``fgd_fast.__version__`` imports it. Record each release in CHANGELOG.md."""

__version__ = "0.1.0"
