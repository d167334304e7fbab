"""The one base class for errors a user can cause.

Why: the command line prints these as one line with exit code 2 and the server answers them
with a 400; every other exception is a bug and keeps its traceback (CLI) or becomes a logged,
generic 500 (server). It subclasses ValueError so `except ValueError` callers keep working.
"""


class AttnlabError(ValueError):
    """Bad input from the user (a file, an option, a text, a request): its message says what and where."""
