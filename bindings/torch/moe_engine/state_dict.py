"""Expert-parameter key normalisation between the single-grouped and per-expert layouts, applied
when a state dict is loaded into a GroupedMLP (docs/semantics.md, Weight layouts and checkpoints)."""
import torch

# Dimensions of one expert's tensor: a weight [out, in], a bias [out].
EXPERT_DIMS = {"weight": 2, "bias": 1}


def split_experts(t, num_experts, expert_dims):
    """The E per-expert pieces of a grouped tensor -- [E, ...] with expert_dims + 1 dimensions, or
    flat [E * out, ...] with expert_dims dimensions (TE's single grouped weight) -- as views of it;
    None when `t` is neither (a scalar, a tensor of another rank, a first dimension E does not
    divide)."""
    if not isinstance(t, torch.Tensor):
        return None
    if t.dim() == expert_dims + 1 and t.shape[0] == num_experts:
        return list(t.unbind(0))
    if t.dim() == expert_dims and expert_dims >= 1 and t.shape[0] % num_experts == 0:
        return list(t.chunk(num_experts, 0))
    return None


def normalize_expert_keys(state_dict, prefix, num_experts, per_expert, params=("fc1", "fc2")):
    """Rewrites `state_dict` in place so that its keys under `prefix` match the layer's layout.

    Layer single grouped: if P.weight is absent and all of P.weight0..P.weight{E-1} are present,
    they are stacked into P.weight; if only some are present, KeyError naming the missing keys.
    Layer per expert: if no P.weight{i} is present and P.weight is, it is split (a first dimension
    of E, or a flat [E * out, in] chunked evenly; anything else is a ValueError naming the key).
    Otherwise the dict is left alone; a target key that is already present is never overwritten.
    The same for bias. `prefix` is '' or ends with '.'."""
    if prefix and not prefix.endswith("."):
        raise ValueError(f"argument 'prefix': expected '' or a prefix ending with '.', got '{prefix}'")
    E = num_experts
    for p in params:
        for suffix in ("weight", "bias"):
            grouped = f"{prefix}{p}.{suffix}"
            parts = [f"{grouped}{i}" for i in range(E)]
            present = [k for k in parts if k in state_dict]
            if not per_expert:
                if grouped in state_dict or not present:
                    continue
                missing = [k for k in parts if k not in state_dict]
                if missing:
                    raise KeyError(f"cannot fold per-expert keys into '{grouped}': missing {missing}")
                state_dict[grouped] = torch.stack([state_dict.pop(k) for k in parts])
            else:
                if present or grouped not in state_dict:
                    continue
                t = state_dict[grouped]
                chunks = split_experts(t, E, EXPERT_DIMS[suffix])
                if chunks is None:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"cannot split '{grouped}' ({shape}) into {E} experts: expected [{E}, ...] "
                                     f"with {EXPERT_DIMS[suffix] + 1} dimensions or [{E} * n, ...] with "
                                     f"{EXPERT_DIMS[suffix]}")
                del state_dict[grouped]
                for k, c in zip(parts, chunks):
                    state_dict[k] = c.contiguous()
    return state_dict
