"""The error every model loader raises for a file it cannot use (shared by the loaders, which
therefore do not import each other)."""


class ModelLoadError(ValueError):
    """A checkpoint could not be used; the message names the file and the problem."""


def load_error(path: str, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: {problem}")
