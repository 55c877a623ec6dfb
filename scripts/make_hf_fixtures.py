#!/usr/bin/env python3
"""Makes the Hugging Face checkpoint fixtures of tests/fixtures/hf/ with the real `transformers`.

For each MoE family: a tiny random model (one decoder layer) is built from its own config class,
saved with the model's OWN `save_pretrained` (so the file carries whatever key names and layouts
that version of transformers writes: per-expert w1/w2/w3 or gate_proj/up_proj/down_proj for most
families, the fused interleaved gate_up_proj with biases for GPT-OSS), and the layer's MoE block is
run on random tokens. A hook on the block's `experts` module records exactly what the block hands
its experts -- the tokens, the top-k expert indices and the routing weights after the family's own
softmax / top-k renormalisation / scaling -- and what the experts return. Those are saved as
`io.safetensors`:

    x        F32 [T, H]   tokens fed to the experts
    indices  I32 [T, k]   top-k expert of each slot
    probs    F32 [T, k]   the weight HF multiplies each slot's expert output by
    y        F32 [T, H]   the experts' output (shared experts, if any, are not included)

The C++ tests load model.safetensors through our Hugging Face mapping and check that the CPU
reference reproduces `y` (tests/cpu/test_hf_fixtures.cpp), and that `moe-engine convert` round-trips
model.safetensors bit for bit (tests/cpu/test_convert_cli.cpp).

Weights are drawn again after construction (normal, family-specific scale) so that the biases are
not zero and GPT-OSS's clamps are actually reached. Everything runs on the CPU in fp32 with the
"eager" experts implementation (the model's reference loop), so the outputs are deterministic.
One family (qwen3_moe) is saved in bf16 to exercise bf16 loading; its outputs are computed by the
same model in fp32 with those bf16 values, so the comparison stays tight.

An FP8 checkpoint in DeepSeek-V3's released form (F8_E4M3 weights with 128x128 `weight_scale_inv`)
goes to tests/fixtures/hf/deepseek_v3_fp8/ (tests/cpu/test_hf_fp8.cpp).

A sharded checkpoint (two Qwen3-MoE layers whose experts spread over several shards, with the index
save_pretrained writes) goes to tests/fixtures/hf_sharded/qwen3_moe/ (tests/cpu/test_convert_sharded.cpp).

Usage: python3 scripts/make_hf_fixtures.py [--out tests/fixtures/hf] [--families mixtral,...]
       [--sharded-out tests/fixtures/hf_sharded]
Needs torch and transformers (>= 5, made with 5.17 and torch 2.11).
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file

T = 16  # tokens
H = 64  # hidden
F = 32  # expert FFN size
F_NARROW = 24  # the FFN size of the families added later: 2 F != H, so that no gate_up tensor is square


def family_specs():
    """name -> (config class, model class, config kwargs, activation, experts attribute path)."""
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig,
                              Glm4MoeConfig, Glm4MoeForCausalLM, GptOssConfig, GptOssForCausalLM,
                              GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, JambaConfig, JambaForCausalLM,
                              Mistral4Config, Mistral4ForCausalLM, MixtralConfig, MixtralForCausalLM, NemotronHConfig,
                              NemotronHForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3VLMoeTextConfig,
                              Qwen3VLMoeTextModel, DeepseekV4Config, DeepseekV4ForCausalLM, HYV4Config,
                              HYV4ForCausalLM, Glm5NextConfig, Glm5NextForConditionalGeneration,
                              MiniMaxM3VLConfig, MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLTextConfig,
                              MiniMaxM3VLForCausalLM, InklingConfig, InklingForConditionalGeneration,
                              OpenAIPrivacyFilterConfig, OpenAIPrivacyFilterForTokenClassification)

    common = dict(vocab_size=16, hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return {
        # name: (config cls, model cls, kwargs, activation, weight scale, dtype)
        "mixtral": (MixtralConfig, MixtralForCausalLM,
                    dict(common, intermediate_size=F, num_local_experts=4, num_experts_per_tok=2, head_dim=32),
                    "swiglu", 0.15, torch.float32),
        # Qwen2-MoE does not renormalise the top-k probs by default: the saved probs do not sum to 1.
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                      dict(common, intermediate_size=F, moe_intermediate_size=F, shared_expert_intermediate_size=F,
                           num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
                      "swiglu", 0.15, torch.float32),
        # E = 8, saved in bf16.
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                      dict(common, intermediate_size=F, moe_intermediate_size=F, num_experts=8, num_experts_per_tok=2,
                           decoder_sparse_step=1, mlp_only_layers=[], head_dim=32, norm_topk_prob=True),
                      "swiglu", 0.15, torch.bfloat16),
        # top-1 routing.
        "olmoe": (OlmoeConfig, OlmoeForCausalLM,
                  dict(common, intermediate_size=F, num_experts=4, num_experts_per_tok=1),
                  "swiglu", 0.15, torch.float32),
        # Group-limited routing with a routed scaling factor; a shared expert the fixture leaves out.
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM,
                        dict(common, intermediate_size=F, moe_intermediate_size=F, n_routed_experts=4,
                             num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=2,
                             first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                             qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True),
                        "swiglu", 0.15, torch.float32),
        # Model types read as a family's naming (docs/checkpoints.md): GLM-4.5 as qwen2_moe (a shared expert,
        # sigmoid routing with a correction bias), Jamba (experts under feed_forward, beside Mamba mixers).
        "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM,
                     dict(common, intermediate_size=48, moe_intermediate_size=F, n_routed_experts=4, n_shared_experts=1,
                          num_experts_per_tok=2, first_k_dense_replace=0, head_dim=32, n_group=1, topk_group=1),
                     "swiglu", 0.15, torch.float32),
        "jamba": (JambaConfig, JambaForCausalLM,
                  dict(common, intermediate_size=F, num_experts=4, num_experts_per_tok=2, expert_layer_period=1,
                       expert_layer_offset=0, attn_layer_period=1, attn_layer_offset=0, use_mamba_kernels=False),
                  "swiglu", 0.15, torch.float32),
        # Not gated: down(relu(up x)^2) (Nemotron-H's MoE layers, mixed with Mamba mixers); a shared expert
        # the fixture leaves out.
        "nemotron_h": (NemotronHConfig, NemotronHForCausalLM,
                       dict(common, layer_types=["moe"], intermediate_size=48, moe_intermediate_size=F,
                            moe_shared_expert_intermediate_size=48, n_routed_experts=4, n_shared_experts=1,
                            num_experts_per_tok=2, head_dim=32, mamba_num_heads=4, mamba_head_dim=16,
                            ssm_state_size=16, n_groups=1),
                       "squared_relu", 0.15, torch.float32),
        # Stored fused as held in memory: gate_up_proj [E, 2F, H] and down_proj [E, H, F] (Mistral 4; Gemma 4
        # with GeGLU and its experts beside a dense MLP), or granite's input_linear / output_linear.
        "mistral4": (Mistral4Config, Mistral4ForCausalLM,
                     dict(common, intermediate_size=48, moe_intermediate_size=F, n_routed_experts=4,
                          n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=0, kv_lora_rank=16,
                          q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                     "swiglu", 0.15, torch.float32),
        "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM,
                   dict(common, intermediate_size=48, head_dim=16, global_head_dim=16, layer_types=["full_attention"],
                        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=F,
                        hidden_size_per_layer_input=0, vocab_size_per_layer_input=16),
                   "geglu", 1.0, torch.float32),
        "granitemoe": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM,
                       dict(common, intermediate_size=F, num_local_experts=4, num_experts_per_tok=2,
                            shared_intermediate_size=48, layer_types=["attention"], mamba_n_heads=4, mamba_d_state=16,
                            mamba_chunk_size=16),
                       "swiglu", 0.15, torch.float32),
        # Qwen3-VL-MoE's language model, saved as its released files are: fused and transposed.
        "qwen3_vl_moe": (Qwen3VLMoeTextConfig, Qwen3VLMoeTextModel,
                         dict(common, intermediate_size=48, moe_intermediate_size=F, num_experts=4,
                              num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], head_dim=32),
                         "swiglu", 0.15, torch.float32),
        # SiLU-gated experts clamped at swiglu_limit (default 10): DeepSeek-V4 (Mixtral's w1 / w3 / w2 under
        # ffn.experts) and Hunyuan v4 (stored fused); a scale of 1 so that the clamps are reached.
        "deepseek_v4": (DeepseekV4Config, DeepseekV4ForCausalLM,
                        dict(common, num_key_value_heads=1, moe_intermediate_size=F, n_routed_experts=4,
                             n_shared_experts=1, num_experts_per_tok=2, mlp_layer_types=["moe"], head_dim=32,
                             q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
                             index_topk=8, num_nextn_predict_layers=0),
                        "clamped_silu", 1.0, torch.float32),
        # GLM-5-Next: a vision-language model; its language model's experts in qwen's per-expert naming.
        "glm5_next": (Glm5NextConfig, Glm5NextForConditionalGeneration,
                      dict(text_config=dict(common, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
                                            moe_intermediate_size=F, n_routed_experts=4, n_shared_experts=1,
                                            num_experts_per_tok=2, mlp_layer_types=["sparse"],
                                            layer_types=["linear_attention"], kv_lora_rank=16, q_lora_rank=32,
                                            qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, index_topk=16,
                                            index_head_dim=16, index_n_heads=2, index_kpool=4, linear_head_dim=16,
                                            linear_num_heads=4),
                           vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4,
                                              image_size=16, out_hidden_size=H, projection_intermediate_size=64)),
                      "clamped_silu", 1.0, torch.float32),
        # MiniMax-M3: GPT-OSS's clamped SwiGLU (alpha 1.702, limit 7, +1) on Mixtral's w1 / w3 / w2, no biases;
        # a vision-language model.
        "minimax_m3_vl": (MiniMaxM3VLConfig, MiniMaxM3SparseForConditionalGeneration,
                          dict(text_config=dict(common, num_attention_heads=4, num_key_value_heads=2,
                                                intermediate_size=F, num_local_experts=4, num_experts_per_tok=2,
                                                head_dim=16, rotary_dim=8, dense_intermediate_size=48,
                                                shared_intermediate_size=48, mlp_layer_types=["sparse"],
                                                layer_types=["full_attention"]),
                               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=16, patch_size=4),
                               projector_hidden_size=H),
                          "clamped_swiglu", 0.5, torch.float32),
        # MiniMax-M3's language model alone: the same experts, saved fused as held in memory.
        "minimax_m3_vl_text": (MiniMaxM3VLTextConfig, MiniMaxM3VLForCausalLM,
                               dict(common, num_attention_heads=4, num_key_value_heads=2, intermediate_size=F_NARROW,
                                    num_local_experts=4, num_experts_per_tok=2, head_dim=16, rotary_dim=8,
                                    dense_intermediate_size=48, shared_intermediate_size=48,
                                    mlp_layer_types=["sparse"], layer_types=["full_attention"]),
                               "clamped_swiglu", 0.5, torch.float32),
        # Inkling (vision, audio and text): its conversion stores the language model's experts fused with
        # the gate and up rows alternating (w13_weight) and down as w2_weight, under model.llm.
        "inkling_mm_model": (InklingConfig, InklingForConditionalGeneration,
                             dict(text_config=dict(common, num_attention_heads=4, num_key_value_heads=2,
                                                   intermediate_size=48, moe_intermediate_size=F_NARROW,
                                                   n_routed_experts=4,
                                                   n_shared_experts=1, num_experts_per_tok=2,
                                                   mlp_layer_types=["sparse"], layer_types=["hybrid"], head_dim=16,
                                                   swa_num_attention_heads=4, swa_num_key_value_heads=2,
                                                   swa_head_dim=16),
                                  vision_config=dict(patch_size=4, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2),
                                  audio_config=dict(n_mel_bins=8, mel_vocab_size=16)),
                             "swiglu", 0.15, torch.float32),
        # OpenAI's privacy filter: GPT-OSS's layout and clamp, with [gate | up] halves instead of interleaved
        # columns.
        "openai_privacy_filter": (OpenAIPrivacyFilterConfig, OpenAIPrivacyFilterForTokenClassification,
                                  dict(common, intermediate_size=F_NARROW, num_local_experts=4,
                                       num_experts_per_tok=2, head_dim=32),
                                  "clamped_swiglu", 0.5, torch.float32),
        "hy_v4": (HYV4Config, HYV4ForCausalLM,
                  dict(common, intermediate_size=48, moe_intermediate_size=F, n_routed_experts=4, n_shared_experts=1,
                       num_experts_per_tok=2, mlp_layer_types=["sparse"], head_dim=32, kv_lora_rank=16,
                       q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=8,
                       index_head_dim=16, index_n_heads=2),
                  "clamped_silu", 1.0, torch.float32),
        # Clamped SwiGLU (alpha 1.702, limit 7, +1 on the linear half) with biases; a large scale so that
        # the clamps are reached.
        "gpt_oss": (GptOssConfig, GptOssForCausalLM,
                    dict(common, intermediate_size=F, num_local_experts=4, num_experts_per_tok=2, head_dim=32,
                         layer_types=["full_attention"], sliding_window=8),
                    "clamped_swiglu", 0.5, torch.float32),
    }


# Each family's seed is --seed plus its offset here: the committed fixtures were made with these.
SEED_OFFSETS = {"mixtral": 0, "qwen2_moe": 1, "qwen3_moe": 2, "olmoe": 3, "deepseek_v3": 4, "gpt_oss": 5,
                "glm4_moe": 5, "jamba": 6, "nemotron_h": 7, "mistral4": 8, "gemma4": 9, "granitemoe": 10,
                "qwen3_vl_moe": 11, "deepseek_v4": 12, "hy_v4": 13, "glm5_next": 14, "minimax_m3_vl": 15,
                "minimax_m3_vl_text": 16, "inkling_mm_model": 17, "openai_privacy_filter": 18}
# The families made with F_NARROW.
NARROW = {"minimax_m3_vl_text", "inkling_mm_model", "openai_privacy_filter"}

# Families whose experts sit in the decoder layer itself (beside its dense MLP), which needs the
# model's position embeddings: the whole model runs on random token ids, and the hook records what the
# layer hands its experts.
WHOLE_MODEL = {"gemma4"}
# Families whose released checkpoints hold the fused experts transposed (x @ W): gate_up_proj [E, H, 2F],
# down_proj [E, F, H].
RELEASED_TRANSPOSED = {"qwen3_vl_moe"}


def find_moe_block(model):
    """The (name, module) of the one module that owns an `experts` child."""
    for name, module in model.named_modules():
        if hasattr(module, "experts") and isinstance(module.experts, torch.nn.Module):
            return name, module
    raise RuntimeError(f"{type(model).__name__}: no module with an `experts` child")


@contextlib.contextmanager
def saved_by_transformers(model, **kwargs):
    """A temporary folder holding what the model's own save_pretrained(**kwargs) wrote."""
    tmp = tempfile.mkdtemp()
    try:
        model.save_pretrained(tmp, **kwargs)
        yield tmp
    finally:
        shutil.rmtree(tmp)


def copy_saved_files(model, target, keep=lambda f: f in ("model.safetensors", "config.json"), **kwargs):
    """save_pretrained(**kwargs), then the files `keep` selects copied into target."""
    os.makedirs(target, exist_ok=True)
    with saved_by_transformers(model, **kwargs) as tmp:
        for f in sorted(os.listdir(tmp)):
            if keep(f):
                shutil.copyfile(os.path.join(tmp, f), os.path.join(target, f))


def saved_state_and_config(model):
    """The tensors and config.json the model's own save_pretrained writes."""
    with saved_by_transformers(model) as tmp:
        with open(os.path.join(tmp, "config.json")) as fh:
            return load_file(os.path.join(tmp, "model.safetensors")), json.load(fh)


def record_experts_io(experts, run):
    """Runs run() with a hook on the experts module that records exactly what the block hands its
    experts -- the tokens, the top-k expert indices, the routing weights after the family's own softmax /
    top-k renormalisation / scaling -- and what the experts return: {x, indices, probs, y}."""
    captured = {}

    def hook(module, args, kwargs_, output):
        a = list(args) + [kwargs_[k] for k in ("top_k_index", "top_k_weights", "router_indices", "routing_weights")
                          if k in kwargs_]
        captured["x"], captured["indices"], captured["probs"] = a[0], a[1], a[2]
        captured["y"] = output

    handle = experts.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        run()
    handle.remove()
    return captured


def make_family(name, spec, out_dir, seed):
    cfg_cls, model_cls, kwargs, activation, scale, save_dtype = spec
    torch.manual_seed(seed)
    config = cfg_cls(**kwargs)
    model = model_cls(config).eval()
    model.set_experts_implementation("eager")
    block_name, block = find_moe_block(model)
    experts = block.experts

    # Redraw every parameter: nonzero biases, activations of a useful size (see module docstring).
    with torch.no_grad():
        for pname, p in model.named_parameters():
            s = scale if pname.startswith(block_name + ".experts.") else 0.15
            p.copy_(torch.randn_like(p) * s)
            # Routers' multipliers of the routing weights (Gemma 4's per expert, Inkling's global one): kept at
            # 1, so that the routed outputs stay of a useful size.
            if pname.endswith("per_expert_scale") or pname.endswith(".gate.global_scale"):
                p.fill_(1.0)
        if save_dtype != torch.float32:
            # The saved values, exactly: the fp32 run below uses the bf16-rounded weights.
            for p in model.parameters():
                p.copy_(p.to(save_dtype).to(torch.float32))

    x = torch.randn(1, T, H)
    if name in WHOLE_MODEL:
        captured = record_experts_io(experts, lambda: model(torch.randint(0, kwargs["vocab_size"], (1, T))))
    else:
        captured = record_experts_io(experts, lambda: block(x))

    xs, idx, probs, y = (captured[k] for k in ("x", "indices", "probs", "y"))
    assert xs.shape == (T, H), xs.shape
    k = idx.shape[1]
    assert probs.shape == (T, k), f"{name}: routing weights have shape {tuple(probs.shape)}, expected [T, k]"
    assert y.shape == (T, H)

    # Save with the model's own code, then keep its model.safetensors and config.json.
    fam_dir = os.path.join(out_dir, name)
    copy_saved_files(model.to(save_dtype), fam_dir)
    if name in RELEASED_TRANSPOSED:
        # The released files' form, which transformers' qwen3_vl_moe conversion (Transpose(1, 2)) turns
        # into the in-memory one on loading, but which its save_pretrained (5.17) does not write back.
        path = os.path.join(fam_dir, "model.safetensors")
        state = load_file(path)
        for key in list(state):
            if key.endswith(".experts.gate_up_proj") or key.endswith(".experts.down_proj"):
                state[key] = state[key].transpose(1, 2).contiguous()
        save_file(state, path, metadata={"format": "pt"})

    # Where the experts of the layer live in the saved file.
    saved_keys = sorted(load_file(os.path.join(fam_dir, "model.safetensors")).keys())
    expert_keys = [k_ for k_ in saved_keys if ".experts." in k_ and ".shared" not in k_]

    meta = {
        "family": name,
        "activation": activation,
        "hidden": str(H),
        "ffn": str(F_NARROW if name in NARROW else F),
        "experts": str(experts.num_experts),
        "topk": str(k),
        "tokens": str(T),
        "weights_dtype": str(save_dtype).replace("torch.", ""),
        "moe_block": block_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seed": str(seed),
    }
    save_file({"x": xs.contiguous().float(), "indices": idx.to(torch.int32).contiguous(),
               "probs": probs.contiguous().float(), "y": y.contiguous().float()},
              os.path.join(fam_dir, "io.safetensors"), metadata=meta)

    info = {"expert_keys_first": expert_keys[:6], "num_expert_keys": len(expert_keys),
            "probs_row_sums": [round(v, 4) for v in probs.sum(-1)[:4].tolist()]}
    if activation in ("clamped_swiglu", "clamped_silu"):
        # How often the clamps bite (a fixture that never clamps would not test them).
        limit = 7.0 if activation == "clamped_swiglu" else 10.0
        with torch.no_grad():
            if hasattr(experts, "gate_up_proj_bias"):  # x @ W with biases: GPT-OSS interleaved, or halves
                gu = torch.einsum("th,ehc->etc", xs, experts.gate_up_proj.float()) + experts.gate_up_proj_bias.float()[:, None]
                gate, up = (gu[..., ::2], gu[..., 1::2]) if name == "gpt_oss" else gu.chunk(2, dim=-1)
            else:  # [gate ; up] rows
                gu = torch.einsum("th,ech->etc", xs, experts.gate_up_proj.float())
                gate, up = gu.chunk(2, dim=-1)
            info["gate_clamped"] = round((gate > limit).float().mean().item(), 3)
            info["up_clamped"] = round((up.abs() > limit).float().mean().item(), 3)
    print(f"{name}: block {block_name}, E={experts.num_experts} k={k}, {info}")


def make_fp8(out_dir, seed):
    """DeepSeek-V3 as its FP8 checkpoints are released: every expert projection (routed and shared)
    stored as F8_E4M3 with fp32 `weight_scale_inv` per 128x128 block, quantized by transformers' own
    FP8 quantizer (`Fp8Quantize`, what saving a FineGrainedFP8 model runs; the FP8 load path itself
    needs a GPU), and `config.json` carrying the `quantization_config` such checkpoints carry. The
    experts' output `y` is the block's, run with the weights transformers' `Fp8Dequantize` gives back.
    H = 128 and F = 256 (two 128-row blocks per projection, so a GLU interleave of 128 moves blocks)."""
    from types import SimpleNamespace

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    h, f = 128, 256
    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=16, hidden_size=h, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=f, moe_intermediate_size=f,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=2,
                              first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(config).eval()
    model.set_experts_implementation("eager")
    block_name, block = find_moe_block(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.15)
    quantizer = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=[128, 128], scale_fmt=None))
    quantize, dequantize = Fp8Quantize(quantizer), Fp8Dequantize(quantizer)

    state, cfg = saved_state_and_config(model)
    fp8 = {}
    for key, value in state.items():
        if ".experts." in key or ".shared_experts." in key:
            fp8.update(quantize._quantize_one(key, value))
        else:
            fp8[key] = value
    # The block runs with what the FP8 weights decode to: every (weight, weight_scale_inv) pair dequantized.
    decoded = {k: dequantize._dequantize_one(v, fp8[k + "_scale_inv"], output_dtype=torch.float32)
               for k, v in fp8.items() if k + "_scale_inv" in fp8}
    with torch.no_grad():
        experts = block.experts
        E = experts.num_experts
        pre = block_name + ".experts."
        experts.gate_up_proj.copy_(torch.stack([torch.cat([decoded[f"{pre}{e}.gate_proj.weight"],
                                                           decoded[f"{pre}{e}.up_proj.weight"]]) for e in range(E)]))
        experts.down_proj.copy_(torch.stack([decoded[f"{pre}{e}.down_proj.weight"] for e in range(E)]))
        for name, p in block.shared_experts.named_parameters():
            p.copy_(decoded[f"{block_name}.shared_experts.{name}"])

    captured = record_experts_io(block.experts, lambda: block(torch.randn(1, T, h)))

    target = os.path.join(out_dir, "deepseek_v3_fp8")
    os.makedirs(target, exist_ok=True)
    save_file(fp8, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}
    with open(os.path.join(target, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")
    k = captured["indices"].shape[1]
    meta = {"family": "deepseek_v3", "activation": "swiglu", "hidden": str(h), "ffn": str(f),
            "experts": str(block.experts.num_experts), "topk": str(k), "tokens": str(T), "weights_dtype": "float8_e4m3",
            "moe_block": block_name, "torch": torch.__version__, "transformers": transformers.__version__,
            "seed": str(seed)}
    save_file({"x": captured["x"].contiguous().float(), "indices": captured["indices"].to(torch.int32).contiguous(),
               "probs": captured["probs"].contiguous().float(), "y": captured["y"].contiguous().float()},
              os.path.join(target, "io.safetensors"), metadata=meta)
    n_fp8 = sum(1 for v in fp8.values() if v.dtype == torch.float8_e4m3fn)
    print(f"deepseek_v3_fp8: {n_fp8} FP8 weights with block scales, E={E} k={k}, max |y| "
          f"{captured['y'].abs().max().item():.3g}")


def make_mxfp4(out_dir, seed):
    """GPT-OSS as its checkpoints are released: the experts' weights in MXFP4 (`gate_up_proj_blocks`
    U8 [E, 2F, H / 32, 16], two E2M1 codes a byte, with E8M0 `gate_up_proj_scales` U8 [E, 2F, H / 32];
    `down_proj` the same along F), everything else in bf16. Random codes and scales 119..128; the block's
    output `y` is computed (in fp32) with the weights transformers' own `convert_moe_packed_tensors`
    decodes, which io.safetensors also holds (`gate_up_decoded` [E, H, 2F], `down_decoded` [E, F, H],
    bf16) for a bit-for-bit check of our decoder."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(seed)
    E, k = 4, 2
    config = GptOssConfig(vocab_size=16, hidden_size=H, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k,
                          head_dim=32, layer_types=["full_attention"], sliding_window=8, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = GptOssForCausalLM(config).eval()
    model.set_experts_implementation("eager")
    block_name, block = find_moe_block(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn_like(p) * 0.15).to(torch.bfloat16).float())
    packed = {
        "gate_up_proj": (torch.randint(0, 256, (E, 2 * F, H // 32, 16), dtype=torch.uint8),
                         torch.randint(119, 129, (E, 2 * F, H // 32), dtype=torch.uint8)),
        "down_proj": (torch.randint(0, 256, (E, H, F // 32, 16), dtype=torch.uint8),
                      torch.randint(119, 129, (E, H, F // 32), dtype=torch.uint8)),
    }
    decoded = {name: convert_moe_packed_tensors(b, s_, dtype=torch.bfloat16) for name, (b, s_) in packed.items()}
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(decoded["gate_up_proj"].float())
        block.experts.down_proj.copy_(decoded["down_proj"].float())

    captured = record_experts_io(block.experts, lambda: block(torch.randn(1, T, H)))

    state, cfg = saved_state_and_config(model.to(torch.bfloat16))
    pre = block_name + ".experts."
    for name, (b, s_) in packed.items():
        del state[pre + name]
        state[pre + name + "_blocks"] = b
        state[pre + name + "_scales"] = s_
    target = os.path.join(out_dir, "gpt_oss_mxfp4")
    os.makedirs(target, exist_ok=True)
    save_file(state, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    with open(os.path.join(target, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")
    meta = {"family": "gpt_oss", "activation": "clamped_swiglu", "hidden": str(H), "ffn": str(F), "experts": str(E),
            "topk": str(k), "tokens": str(T), "weights_dtype": "mxfp4", "moe_block": block_name,
            "torch": torch.__version__, "transformers": transformers.__version__, "seed": str(seed)}
    save_file({"x": captured["x"].contiguous().float(), "indices": captured["indices"].to(torch.int32).contiguous(),
               "probs": captured["probs"].contiguous().float(), "y": captured["y"].contiguous().float(),
               "gate_up_decoded": decoded["gate_up_proj"].contiguous(), "down_decoded": decoded["down_proj"].contiguous()},
              os.path.join(target, "io.safetensors"), metadata=meta)
    print(f"gpt_oss_mxfp4: E={E} k={k}, max |y| {captured['y'].abs().max().item():.3g}")


def make_llama4(out_dir, seed):
    """Llama 4's language model as its save_pretrained writes it: feed_forward.experts.gate_up_proj
    [E, H, 2F] (x @ W, gate and up halves) and down_proj [E, F, H], beside a shared expert. Its experts
    take inputs already scaled by the router (not the top-k call of the other families), so only the
    file is kept: tests/cpu/test_convert_cli.cpp converts it to our layouts and back."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    torch.manual_seed(seed)
    config = Llama4TextConfig(vocab_size=16, hidden_size=H, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=F, intermediate_size_mlp=48, num_local_experts=4,
                              num_experts_per_tok=1, head_dim=32, moe_layers=[0], pad_token_id=0, bos_token_id=1,
                              eos_token_id=2)
    model = Llama4ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.15)
    copy_saved_files(model, os.path.join(out_dir, "llama4"))
    print("llama4: file only (experts fused, x @ W)")


def make_sharded(out_dir, seed):
    """A two-layer Qwen3-MoE model (E = 4, bf16) saved by save_pretrained in shards of at most 40 KB, so
    that each layer's experts spread over several shards: model-0000i-of-0000N.safetensors and
    model.safetensors.index.json, as transformers writes them for models larger than one file."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=16, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=F, moe_intermediate_size=F, num_experts=4,
                            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], head_dim=32,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.15).to(p.dtype))
    target = os.path.join(out_dir, "qwen3_moe")
    shutil.rmtree(target, ignore_errors=True)
    copy_saved_files(model, target, keep=lambda f: f.endswith((".safetensors", ".index.json")) or f == "config.json",
                     max_shard_size="40KB")
    with open(os.path.join(target, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    print(f"sharded qwen3_moe: {len(shards)} shards, {len(index['weight_map'])} tensors, metadata {index['metadata']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf"))
    ap.add_argument("--families", default=",".join(family_specs().keys()))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--sharded-out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures",
                                                          "hf_sharded"),
                    help="where the sharded checkpoint fixture goes ('' to skip it)")
    ap.add_argument("--fp8", default=True, action=argparse.BooleanOptionalAction,
                    help="also make deepseek_v3_fp8 (the experts in FP8 with 128x128 block scales) and "
                         "gpt_oss_mxfp4 (GPT-OSS's released MXFP4 experts)")
    args = ap.parse_args()
    specs = family_specs()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.set_num_threads(1)  # deterministic CPU reductions
    for name in args.families.split(","):
        # A seed per family, independent of which families are made in this run and of their order.
        make_family(name, specs[name], args.out, args.seed + SEED_OFFSETS[name])
    make_llama4(args.out, args.seed + 400)
    if args.fp8:
        make_fp8(args.out, args.seed + 200)
        make_mxfp4(args.out, args.seed + 300)
    if args.sharded_out:
        make_sharded(args.sharded_out, args.seed + 100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
