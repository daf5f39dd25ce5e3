"""Upper bounds of the spec's fields (trainspec.core.spec): values no run on today's machines
reaches. A value above one is a typo or a unit error; refused when the spec is validated, it
is one line naming the field, where it would otherwise be met as a run that never ends, a
timeout that never fires, or a model the host spends minutes allocating before it dies."""
import re

MAX_STEPS = 10**9  # optimizer steps, and every interval or window counted in steps
MAX_TIMEOUT_S = 86_400.0  # a collective that has waited a day has failed
MAX_DEVICES = 2**20  # devices of a mesh axis, device ids
MAX_SEQUENCES = 2**24  # sequences of a batch
MAX_WIDTH = 2**20  # tokens of a sequence, vocabulary entries, compression blocks
MAX_MODEL_WIDTH = 2**17  # d_model, d_ff: eight times the widest published dense model's
MAX_LAYERS = 256  # the deepest published models have about 130
MAX_PARAMETERS = 10**13  # the reference model's: ten times the largest published
MAX_KEPT = 10**4  # checkpoints kept
# A mesh axis name: what XLA and every framework accept (an ASCII identifier).
AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
