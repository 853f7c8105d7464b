"""rooflm's version: pyproject.toml's, as installed (one source of truth for the CLI, the server's
/version and OpenAPI page, and `rooflm.__version__`)."""

from importlib.metadata import PackageNotFoundError, version


def _installed_version() -> str:
    try:
        return version("rooflm")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


__version__ = _installed_version()
