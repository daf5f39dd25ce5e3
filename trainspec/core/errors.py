"""The exceptions the CLI prints as one line: bad user input (exit 2) and installed packages that
do not fit together (exit 1)."""


class UserInputError(ValueError):
    """Bad input from the user (spec field, CLI argument, file). The message names what is wrong."""


class FfiVersionError(ImportError):
    """The compiled xla_ext handlers do not fit the installed jaxlib; the message says how to fix
    it (trainspec/jax/xla_ext.py)."""
