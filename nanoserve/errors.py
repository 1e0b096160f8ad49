"""User-facing error types. The CLI prints their message as one line and exits non-zero;
anything else is a bug and keeps its traceback."""


class NanoserveError(Exception):
    """Base class of the errors a user can act on."""


class ModelError(NanoserveError):
    """The model files are missing, corrupt, mismatched or of an unsupported kind."""


class InputError(NanoserveError):
    """The job's input is unusable as a whole (no file, no prompt column, ...)."""


class CacheFullError(NanoserveError):
    """The KV block pool cannot hold what was asked of it; nothing was changed."""


def check_positive_int(value, what: str) -> None:
    """Refuse, in one line naming `what`, a value that is not an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NanoserveError(f"{what} must be an int >= 1, got {value!r}")


def first_line(text: str) -> str:
    """The first non-blank line of an error's text (the whole text if none), stripped."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else text
