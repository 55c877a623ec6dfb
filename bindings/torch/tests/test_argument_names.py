"""The PyTorch constructors' errors name the argument the caller passed (`hidden_size`, not the
library's `hidden`; fields named alike keep the library's "config 'topk'"). The library validates a configuration before it touches a device, so these
run without a GPU."""
import pytest
import torch

from moe_engine import GroupedExperts, GroupedMLP
from moe_engine._arg_names import PYTHON_NAMES, python_message
from moe_engine.ops import Dispatcher


@pytest.mark.parametrize("kwargs,name", [
    (dict(hidden_size=12), "hidden_size"),
    (dict(ffn_hidden_size=0), "ffn_hidden_size"),
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts=2**32 + 2), "num_experts"),  # refused by the binding's integer check
    (dict(topk=9), "topk"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(token_chunks=0), "token_chunks"),
])
def test_grouped_mlp_errors_name_its_arguments(kwargs, name):
    args = dict(hidden_size=128, ffn_hidden_size=64, num_experts=8, topk=2, max_tokens=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"'{name}'") as err:
        GroupedMLP(device="cpu", **args)
    assert not any(f"'{field}'" in str(err.value) for field in PYTHON_NAMES)  # no library-only name


@pytest.mark.parametrize("kwargs,name", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(ffn_hidden_size=20), "ffn_hidden_size"),
    (dict(num_experts=70000), "num_experts"),
    (dict(max_rows=-2), "max_rows"),
])
def test_grouped_experts_errors_name_its_arguments(kwargs, name):
    args = dict(hidden_size=128, ffn_hidden_size=64, num_experts=8, max_rows=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"'{name}'"):
        GroupedExperts(device="cpu", **args)


def test_dispatcher_errors_name_its_arguments():
    with pytest.raises(ValueError, match="argument 'hidden_size'"):
        Dispatcher(64, 8, 3, topk=2)
    with pytest.raises(ValueError, match="argument 'num_experts'"):
        Dispatcher(64, 0, 128, topk=2)


def test_only_renamed_fields_change():
    assert python_message("config 'hidden': x; argument 'experts': y") == \
        "argument 'hidden_size': x; argument 'num_experts': y"
    kept = "config 'max_rows': expected 0..2^31-1; argument 'x_perm': bad; config 'fp8': no"
    assert python_message(kept) == kept
    assert torch.ops.moe_engine.mlp_create is not None  # the extension is loaded (the tests above call it)
