"""Errors that are the user's to fix. Their message names the problem and the fix; `run()` prints it as one line
and exits 1 instead of showing a traceback. Anything else (a bug, ours or the recipe's) raises as usual."""


class UserError(RuntimeError):
    """Bad input: a flag, a file, a folder, a checkpoint, a topology. The message says what to do."""
