#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzz target (tests/fuzz/corpus/): small valid files
(every dtype, metadata, scalars, empty tensors, and expert layers in each naming the converter
reads), one file for each way a header can be wrong, and sharded checkpoints' index files. Standard library only; deterministic."""

import json
import os
import struct
import sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
SIZES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "U8": 1, "BOOL": 1,
         "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def raw(header_text, data=b""):
    h = header_text.encode() if isinstance(header_text, str) else header_text
    return struct.pack("<Q", len(h)) + h + data


def st(tensors, metadata=None):
    """tensors: list of (name, dtype, shape); data bytes are a counter pattern."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * SIZES[dtype] if dtype != "F4" else n // 2
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
        data += bytes((len(data) + i) % 251 for i in range(nbytes))
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    return raw(text, data)


def seeds():
    E, H, F = 2, 4, 2
    yield "valid_one_f32", st([("w", "F32", [2, 3])])
    yield "valid_all_dtypes", st([(f"t_{d.lower()}", d, [2]) for d in SIZES] + [("t_f4", "F4", [4])])
    yield "valid_metadata_scalar_empty", st([("s", "F32", []), ("e", "BF16", [0, 3]), ("v", "I64", [3])],
                                            {"format": "pt", "note": "x"})
    yield "valid_ours_grouped", st([("layer.fc1.weight", "BF16", [E, 2 * F, H]), ("layer.fc2.weight", "BF16", [E, H, F]),
                                    ("layer.fc1.bias", "BF16", [E, 2 * F]), ("layer.fc2.bias", "BF16", [E, H])])
    yield "valid_ours_per_expert", st([(f"fc{p}.weight{e}", "F32", [2 * F, H] if p == 1 else [H, F])
                                       for p in (1, 2) for e in range(E)])
    yield "valid_hf_mixtral", st([(f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight", "F32",
                                   [H, F] if w == "w2" else [F, H]) for e in range(E) for w in ("w1", "w2", "w3")]
                                 + [("model.norm.weight", "F32", [H])], {"format": "pt"})
    yield "valid_hf_qwen", st([(f"model.layers.0.mlp.experts.{e}.{w}.weight", "BF16",
                                [H, F] if w == "down_proj" else [F, H])
                               for e in range(E) for w in ("gate_proj", "up_proj", "down_proj")]
                              + [("model.layers.0.mlp.shared_experts.gate_proj.weight", "BF16", [F, H])])
    yield "valid_hf_fused", st([("model.layers.0.mlp.experts.gate_up_proj", "F32", [E, 2 * F, H]),
                                ("model.layers.0.mlp.experts.down_proj", "F32", [E, H, F])])
    yield "valid_hf_gpt_oss", st([("model.layers.0.mlp.experts.gate_up_proj", "F32", [E, H, 2 * F]),
                                  ("model.layers.0.mlp.experts.gate_up_proj_bias", "F32", [E, 2 * F]),
                                  ("model.layers.0.mlp.experts.down_proj", "F32", [E, F, H]),
                                  ("model.layers.0.mlp.experts.down_proj_bias", "F32", [E, H])])
    # Quantized expert weights (data + companions, the format in __metadata__), in both layouts.
    mx = "mxfp8;block=1x32;scale=e8m0;layout=row_major;copies=rowwise"
    yield "valid_ours_quantized_grouped", st(
        [("layer.fc1.weight", "F8_E4M3", [E, 2 * F, H]), ("layer.fc1.weight_scale_inv", "F8_E8M0", [E, 2 * F, 1]),
         ("layer.fc2.weight", "F8_E4M3", [E, H, F]), ("layer.fc2.weight_scale_inv", "F8_E8M0", [E, H, 1])],
        {"moe.quant.layer.fc1.weight": mx, "moe.quant.layer.fc2.weight": mx})
    nv = "nvfp4;block=1x16;scale=e4m3;layout=row_major;copies=rowwise,columnwise"
    yield "valid_ours_quantized_per_expert", st(
        [(f"fc{p}.weight{e}{part}", dtype, shape) for e in range(E) for p in (1, 2)
         for part, dtype, shape in (("", "U8", [2 * F, H // 2] if p == 1 else [H, F // 2]),
                                    ("_scale_inv", "F8_E4M3", [2 * F, 1] if p == 1 else [H, 1]),
                                    ("_columnwise", "U8", [H, F] if p == 1 else [F, H // 2]),
                                    ("_columnwise_scale_inv", "F8_E4M3", [H, 1] if p == 1 else [F, 1]),
                                    ("_amax", "F32", []))],
        {"moe.quant.fc1.weight": nv, "moe.quant.fc2.weight": nv})
    # Invalid: framing.
    yield "bad_empty", b""
    yield "bad_short", b"\x05\x00\x00"
    yield "bad_len_past_end", struct.pack("<Q", 100) + b"{}"
    yield "bad_len_huge", struct.pack("<Q", 2 ** 63) + b"{}"
    yield "bad_not_object", raw("[1,2,3]")
    yield "bad_json", raw('{"a":{"dtype":"F32",')
    yield "bad_utf8", raw(b'{"\xff\xfe":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', b"abcd")
    # Invalid: structure and entries.
    yield "bad_nested", raw('{"a":{"dtype":"F32","shape":[[[[1]]]],"data_offsets":[0,4]}}', b"abcd")
    yield "bad_duplicate", raw('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                               '"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"ab")
    yield "bad_dtype", raw('{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}', b"abcdefgh")
    yield "bad_shape_negative", raw('{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}', b"a")
    yield "bad_shape_overflow", raw('{"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}}',
                                    b"abcdefgh")
    yield "bad_size_mismatch", raw('{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', b"abcdefgh")
    yield "bad_metadata", raw('{"__metadata__":{"k":5}}')
    # Invalid: offsets.
    yield "bad_out_of_file", raw('{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}', b"abcd")
    yield "bad_overlap", raw('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                             '"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}', b"abcdef")
    yield "bad_hole", raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                          '"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}', b"abcdef")
    yield "bad_trailing", raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"abcdef")
    # DeepSeek-V3's FP8 form: F8_E4M3 experts with 128x128 block scales (F = 128 rows: one block).
    yield "valid_hf_fp8_deepseek", st(
        [(f"model.layers.0.mlp.experts.0.{w}{part}", dtype, shape)
         for w, shape in (("gate_proj.weight", [128, 8]), ("up_proj.weight", [128, 8]), ("down_proj.weight", [8, 128]))
         for part, dtype, shape in (("", "F8_E4M3", shape), ("_scale_inv", "F32", [1, 1]))])
    # GPT-OSS's released MXFP4 form (F = H = 32: one block of 32 a row).
    yield "valid_hf_gpt_oss_mxfp4", st(
        [(f"model.layers.0.mlp.experts.{name}", dtype, shape) for name, dtype, shape in (
            ("gate_up_proj_blocks", "U8", [1, 64, 1, 16]), ("gate_up_proj_scales", "U8", [1, 64, 1]),
            ("gate_up_proj_bias", "BF16", [1, 64]), ("down_proj_blocks", "U8", [1, 32, 1, 16]),
            ("down_proj_scales", "U8", [1, 32, 1]), ("down_proj_bias", "BF16", [1, 32]))])
    # Sharded checkpoints' indexes (the same target parses every input as one too).
    yield "index_valid", json.dumps({"metadata": {"total_parameters": 10, "total_size": 40},
                                     "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                                    "b.weight": "model-00002-of-00002.safetensors"}},
                                    indent=2, sort_keys=True).encode() + b"\n"
    yield "index_bad_shard_path", b'{"weight_map": {"a": "../model.safetensors"}}'
    yield "index_bad_duplicate", b'{"weight_map": {"a": "s.safetensors", "a": "t.safetensors"}}'
    # Valid file, invalid expert layer: a missing expert.
    yield "layer_incomplete_mixtral", st([(f"experts.{e}.{w}.weight", "F32", [H, F] if w == "w2" else [F, H])
                                          for e in (0, 2) for w in ("w1", "w2", "w3")])


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, data in seeds():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
