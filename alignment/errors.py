"""User-facing errors.

A `UserError` is bad input (recipe, data, model path, verifier): the CLI prints its message as
one paragraph on stderr and exits with code 2, without a traceback. Anything else is a bug and
keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user; the message names the culprit (file, key, row or column)."""

    exit_code = 2


def row_name(row) -> str:
    """A data row in words: 'row 3' for a 0-based row, or its place in a file as given ('line 4 of d.jsonl')."""
    return f"row {row}" if isinstance(row, int) else str(row)
