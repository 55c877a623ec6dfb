"""Expert-parameter key normalisation between the single-grouped and per-expert layouts, applied
when a state dict is loaded into a GroupedMLP (docs/semantics.md, Weight layouts and checkpoints)."""
import torch


def normalize_expert_keys(state_dict, prefix, num_experts, per_expert, params=("fc1", "fc2")):
    """Rewrites `state_dict` in place so that its keys under `prefix` match the layer's layout.

    Layer single grouped: if P.weight is absent and all of P.weight0..P.weight{E-1} are present,
    they are stacked into P.weight; if only some are present, KeyError naming the missing keys.
    Layer per expert: if no P.weight{i} is present and P.weight is, it is split (first dim E, or a
    multiple of E chunked evenly). Otherwise the dict is left alone; a target key that is already
    present is never overwritten. The same for bias."""
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
                if t.shape[0] == E:
                    chunks = t.unbind(0)
                elif t.shape[0] % E == 0:
                    chunks = t.chunk(E, 0)
                else:
                    raise ValueError(f"cannot split '{grouped}' of shape {tuple(t.shape)} into {E} experts")
                del state_dict[grouped]
                for k, c in zip(parts, chunks):
                    state_dict[k] = c.contiguous()
    return state_dict
