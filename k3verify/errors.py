"""Exceptions the CLI turns into exit codes.

UsageError: the run could not be made (bad flag value, missing input) -> exit 2.
CheckFailed: a check ran and failed -> exit 1 (commands usually return 1 themselves;
this is for code deep inside a check that wants to stop the run).
optimized_stack.errors.K3Error (bad config, checkpoint, preset) also maps to exit 2.
"""


class UsageError(Exception):
    """Bad input from the user; the message is one line saying what was expected and what arrived."""


class CheckFailed(Exception):
    """A check ran and did not pass; the message names the check and the evidence."""
