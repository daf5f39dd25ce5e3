"""The one exception type for bad user input: the CLI prints its message as one line, exit 2."""


class UserInputError(ValueError):
    """Bad input from the user (spec field, CLI argument, file). The message names what is wrong."""
