"""The version of the library, apart from its loading so that any module may read it."""

__version__ = "0.1.0"
