"""The exceptions the CLI prints as one line (trainspec/cli/outcomes.py gives each its exit
status): bad user input, installed packages that do not fit together, a run that cannot go on,
a process the job goes on without."""


class UserInputError(ValueError):
    """Bad input from the user (spec field, CLI argument, file). The message names what is wrong."""


class FfiVersionError(ImportError):
    """The compiled xla_ext handlers do not fit the installed jaxlib; the message says how to fix
    it (trainspec/jax/xla_ext.py)."""


class LeaveNow(UserInputError):
    """The run cannot go on (a checkpoint that cannot be written, a full disk, a peer process
    gone): said in one line, then the process leaves at once, without waiting for the
    framework's threads, which may wait forever for work that will not come."""


class JobLeavesNow(LeaveNow):
    """As LeaveNow, raised on every process of the job alike (a checkpoint save the ranks
    failed together): the process that speaks for the job says it."""


class LeftOut(Exception):
    """This process takes no further part in the job (excluded, or idle on the smaller mesh):
    it leaves without an error."""
