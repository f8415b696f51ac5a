"""Errors that are the user's to fix. Their message names the problem and the fix; `run()` prints it as one line
and exits 1 instead of showing a traceback. Anything else (a bug, ours or the recipe's) raises as usual."""


class UserError(RuntimeError):
    """Bad input: a flag, a file, a folder, a checkpoint, a topology. The message says what to do."""


class OneLineError(UserError):
    """A UserError whose message quotes what a file said (a checkpoint's manifest, a lock's record): control
    characters in it, newlines included, are escaped, so that nothing quoted from a file can start a line of its own
    (an "error: ..." line forged by whoever wrote the file)."""

    def __init__(self, *args):
        super().__init__(*(one_line(a) if isinstance(a, str) else a for a in args))


def why(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def one_line(text: str) -> str:
    """`text` with its control characters (newlines included) escaped as Python writes them in a string."""
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


class ArgumentError(UserError, ValueError):
    """A bad argument value. The message names the flag and what to pass instead. A ValueError too, as it was
    before 0.3 (callers catching that)."""


class MissingExtra(UserError):
    """An optional dependency is not installed: the message names the extra that installs it."""


def need(module: str, extra: str, what: str, distribution: str | None = None):
    """Import `module`, an optional dependency that `pip install 'accel-trainer[extra]'` installs (pyproject.toml),
    or raise MissingExtra naming that command (and `distribution`, the package's name where it is not the module's).
    Only the module itself missing counts: an ImportError raised from inside an installed module is a broken
    install and propagates as it is."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != module.split(".")[0]:
            raise
        raise MissingExtra(
            f"{what} needs {distribution or module.split('.')[0]}, which is not installed: "
            f"pip install 'accel-trainer[{extra}]'"
        ) from None
