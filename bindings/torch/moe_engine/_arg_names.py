"""The library's errors name its configuration fields as the C++ configs spell them (`hidden`,
`ffn`, `experts`, ...); the PyTorch constructors take PyTorch-style arguments (`hidden_size`,
`ffn_hidden_size`, `num_experts`, ...). `create` re-raises a constructor's ValueError with the
caller's names, so the message points at the argument that was passed."""
import re

# C++ field -> the constructor argument that sets it, where the two names differ.
PYTHON_NAMES = {
    "hidden": "hidden_size",
    "ffn": "ffn_hidden_size",
    "experts": "num_experts",
    "probs": "probs_at_combine",
    "layout": "per_expert_weights",
    "wgrad": "accumulate_into_main_grad",
    "routing_form": "map_routing",
}

_FIELD = re.compile(r"(?:config|argument) '(\w+)'")


def python_message(message):
    """`message` with each "config 'field'" / "argument 'field'" of a renamed field as "argument 'name'"."""
    return _FIELD.sub(lambda m: f"argument '{PYTHON_NAMES[m[1]]}'" if m[1] in PYTHON_NAMES else m[0], message)


def create(op, *args):
    """op(*args) (an operator that makes a library object), its ValueError in the caller's names."""
    try:
        return op(*args)
    except ValueError as e:
        message = python_message(str(e))
        if message == str(e):
            raise
        raise ValueError(message) from e
