"""The plain-Python checkpoint helpers (moe_engine.state_dict, the Megatron key and optimizer-state
conversions): no operator runs, so these tests need no GPU (conftest.py collects this file alone on
a machine without one). Values differ per expert, so a reordering or a wrong split shows."""
import copy

import pytest
import torch

from moe_engine.integrations.megatron import (grouped_to_sequential_keys, normalize_optimizer_state,
                                              sequential_to_grouped_keys)
from moe_engine.state_dict import normalize_expert_keys

OWNERS = ("linear_fc1", "linear_fc2")


def per_expert_dict(prefix, E, names=("fc1", "fc2"), out=4, inn=3):
    sd = {}
    for n in names:
        for i in range(E):
            sd[f"{prefix}{n}.weight{i}"] = torch.arange(out * inn, dtype=torch.float32).reshape(out, inn) + 100 * i
            sd[f"{prefix}{n}.bias{i}"] = torch.full((out,), float(i))
    return sd


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("prefix", ["", "model.layers.0.mlp.experts."])
@pytest.mark.parametrize("E", [1, 3, 12])
def test_layouts_round_trip_in_expert_order(prefix, E):
    sd = per_expert_dict(prefix, E)
    sd["other.fc1.weight0"] = torch.ones(1)  # another module's key stays as it is
    want = copy.deepcopy(sd)
    normalize_expert_keys(sd, prefix, E, per_expert=False)
    grouped = sd[f"{prefix}fc1.weight"]
    assert grouped.shape[0] == E and [grouped[i, 0, 0].item() for i in range(E)] == [100.0 * i for i in range(E)]
    again = dict(sd)
    normalize_expert_keys(again, prefix, E, per_expert=False)
    assert same(again, sd)  # idempotent
    normalize_expert_keys(sd, prefix, E, per_expert=True)
    assert same(sd, want)


def test_grouped_tensors_of_another_expert_count_or_rank_are_refused():
    with pytest.raises(ValueError, match="'fc1.weight'"):  # 8 experts where 4 are expected
        normalize_expert_keys({"fc1.weight": torch.zeros(8, 4, 3)}, "", 4, per_expert=True)
    with pytest.raises(ValueError, match="'fc1.bias'"):
        normalize_expert_keys({"fc1.bias": torch.zeros(5)}, "", 2, per_expert=True)
    with pytest.raises(ValueError, match="'fc1.weight'"):
        normalize_expert_keys({"fc1.weight": None}, "", 2, per_expert=True)
    with pytest.raises(ValueError, match="'prefix'"):
        normalize_expert_keys({}, "experts", 2, per_expert=True)
    flat = {"fc1.weight": torch.arange(24.0).reshape(8, 3), "fc1.bias": torch.arange(6.0)}  # TE's [E * out, in]
    normalize_expert_keys(flat, "", 2, per_expert=True)
    assert torch.equal(flat["fc1.weight1"], torch.arange(12.0, 24.0).reshape(4, 3))
    assert torch.equal(flat["fc1.bias1"], torch.tensor([3.0, 4.0, 5.0]))


@pytest.mark.parametrize("E", [2, 12])
def test_sequential_names_round_trip(E):
    prefix = "decoder.layers.0.mlp.experts."
    sd = {f"{prefix}local_experts.{i}.{o}.{w}": torch.full((4, 3) if w == "weight" else (4,), float(i))
          for i in range(E) for o in OWNERS for w in ("weight", "bias")}
    want = copy.deepcopy(sd)
    sequential_to_grouped_keys(sd, prefix, E)
    normalize_expert_keys(sd, prefix, E, per_expert=False, params=OWNERS)
    assert [sd[f"{prefix}linear_fc1.weight"][i, 0, 0].item() for i in range(E)] == list(map(float, range(E)))
    grouped_to_sequential_keys(sd, prefix, E)
    assert same(sd, want)


def test_key_conversions_never_overwrite_and_fail_before_changing_anything():
    sd = {"local_experts.0.linear_fc1.weight": torch.full((2, 2), 100.0), "linear_fc1.weight0": torch.zeros(2, 2),
          "linear_fc1.weight1": torch.ones(2, 2)}
    grouped_to_sequential_keys(sd, "", 2)
    assert sd["local_experts.0.linear_fc1.weight"][0, 0] == 100.0 and "linear_fc1.weight0" in sd
    sd = {"local_experts.0.linear_fc1.weight": torch.zeros(1), "local_experts.5.linear_fc1.weight": torch.zeros(1)}
    with pytest.raises(KeyError, match="expert 5"):
        sequential_to_grouped_keys(sd, "", 2)
    assert sorted(sd) == ["local_experts.0.linear_fc1.weight", "local_experts.5.linear_fc1.weight"]
    sd = {"local_experts.01.linear_fc1.weight": torch.zeros(1)}  # not an expert id
    sequential_to_grouped_keys(sd, "", 2)
    assert list(sd) == ["local_experts.01.linear_fc1.weight"]


def test_optimizer_state_split_gives_each_expert_its_own_fields():
    st = {"linear_fc1.weight": {"step": torch.tensor(5.0), "exp_avg": torch.arange(24.0).reshape(2, 4, 3),
                                "flat": torch.arange(24.0).reshape(8, 3), "extra": [1]}}
    normalize_optimizer_state(st, "", 2, per_expert=True)
    a, b = st["linear_fc1.weight0"], st["linear_fc1.weight1"]
    assert a["step"] is not b["step"] and a["extra"] is not b["extra"]
    a["step"] += 1  # Adam updates its step in place: the other expert's must not move
    assert b["step"] == 5.0
    assert torch.equal(b["exp_avg"], torch.arange(12.0, 24.0).reshape(4, 3))
    assert torch.equal(b["flat"], torch.arange(12.0, 24.0).reshape(4, 3))  # TE's flat [E * out, in] state


def test_optimizer_state_fold_needs_every_field_of_every_expert():
    full = {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 2)}
    with pytest.raises(KeyError, match="'linear_fc1.weight0' has no"):
        normalize_optimizer_state({"linear_fc1.weight0": {}, "linear_fc1.weight1": full}, "", 2, per_expert=False)
    with pytest.raises(KeyError, match="'linear_fc1.weight1' has no"):
        normalize_optimizer_state({"linear_fc1.weight0": full, "linear_fc1.weight1": {"step": torch.tensor(3.0)}},
                                  "", 2, per_expert=False)
    with pytest.raises(ValueError, match="'linear_fc1.weight0'"):
        normalize_optimizer_state({"linear_fc1.weight0": None, "linear_fc1.weight1": full}, "", 2, per_expert=False)
    with pytest.raises(ValueError, match="'step' differs"):
        normalize_optimizer_state({"linear_fc1.weight0": full, "linear_fc1.weight1": dict(full, step=torch.tensor(4.0))},
                                  "", 2, per_expert=False)
    nan = {"linear_fc1.weight0": {"x": float("nan")}, "linear_fc1.weight1": {"x": float("nan")}}
    normalize_optimizer_state(nan, "", 2, per_expert=False)  # equal NaNs agree
    assert list(nan) == ["linear_fc1.weight"]
