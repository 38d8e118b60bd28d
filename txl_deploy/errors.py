"""User-facing errors.

Every problem a user can cause (a bad file, a bad token id, a wrong shape) is raised as a `TxlError` subclass
with a one-line message naming the thing and the problem. The CLI prints it and exits with code 2; library
callers can catch the specific class. Nothing here imports torch.
"""


class TxlError(Exception):
    """Base class of every error txl-deploy raises on purpose."""

    exit_code = 2


class CheckpointError(TxlError):
    """A checkpoint or model file that cannot be read as what it claims to be."""

    def __init__(self, path, problem):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class InputError(TxlError, ValueError):
    """Bad input to a runtime call (token ids, shapes, dtypes, state)."""


class ExportError(TxlError):
    """An export or verification that failed."""


class OutputExistsError(TxlError):
    """An output file exists and --force was not given."""

    def __init__(self, path):
        super().__init__(f"{path}: already exists (pass --force to overwrite)")
