"""The user's side of a split context axis on torch: wrap builds the model with
`model_fn(attention=...)`, the attention across the context ranks; a model_fn that cannot take
it is refused in one line naming mesh.axes.context (it would attend within its own chunks)."""
import pytest

from trainspec.core.errors import UserInputError
from trainspec.torch.step_inputs import with_attention


def across_ranks(q, k, v):
    return q


def test_the_model_is_built_with_the_context_attention():
    assert with_attention(lambda attention: attention, across_ranks) is across_ranks


def test_a_model_fn_without_attention_is_refused_naming_the_axis():
    with pytest.raises(UserInputError) as refused:
        with_attention(lambda: None, across_ranks)
    line = str(refused.value)
    assert line.startswith("mesh.axes.context: a split context axis needs a model_fn that takes "
                           "`attention`") and "\n" not in line
