#!/usr/bin/env python3
"""Writes the seed corpora of gattn's file-reader fuzzers and the decoding seeds of fuzz_sdpa
(Python 3 standard library only).

  tests/fuzz/corpus_safetensors/  safetensors files for tests/fuzz/fuzz_safetensors.cpp
  tests/fuzz/corpus_config/       config.json files for tests/fuzz/fuzz_config.cpp
  tests/fuzz/corpus_index/        model.safetensors.index.json files for tests/fuzz/fuzz_index.cpp
  tests/fuzz/corpus/decode_*      inputs of tests/fuzz/fuzz_sdpa.cpp's decoding mode (a layer
                                  decoding through a KV cache, with invalid calls among the
                                  valid ones); the rest of that corpus is fuzz_sdpa's own merge

Each reader corpus holds valid files and near-valid ones, each a single defect away from valid
(truncated, offsets out of range or overlapping, wrong dtypes, huge or negative numbers,
duplicated names, deep nesting, bad UTF-8, ...). The files are named after what they hold; the
output is deterministic. Files this script does not write (the inputs of past findings, named
finding_*, and fuzz_sdpa's merged inputs) are left as they are. The corpora are replayed by
ctest in the fuzzer build (Fuzz.*CorpusReplay) and seed scripts/fuzz.sh.

Usage: python3 scripts/make_fuzz_seeds.py [--check]
  --check  fail when a corpus file differs from what the script writes (nothing is written).
"""

import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "tests", "fuzz")

# ---------------------------------------------------------------------------------------------
# safetensors

ELEMENT = {"F64": "d", "F32": "f", "F16": "e", "I64": "q", "I32": "i", "I16": "h", "U8": "B", "I8": "b"}
WIDTH_BITS = {"F64": 64, "I64": 64, "C64": 64, "F32": 32, "I32": 32, "F16": 16, "BF16": 16, "I16": 16,
              "U8": 8, "I8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F4": 4}


def values_bytes(dtype, shape):
    """Little-endian bytes of a tensor whose element i is ((7i mod 17) - 8) / 8 (integers: i)."""
    n = 1
    for d in shape:
        n *= d
    xs = [((7 * i) % 17 - 8) / 8.0 for i in range(n)]
    if dtype == "BF16":
        return b"".join(struct.pack("<f", x)[2:] for x in xs)  # exact: few mantissa bits
    if dtype in ("F64", "F32", "F16"):
        return struct.pack("<%d%s" % (n, ELEMENT[dtype]), *xs)
    if dtype in ("I64", "I32", "I16", "I8"):
        return struct.pack("<%d%s" % (n, ELEMENT[dtype]), *[(i % 100) - 50 for i in range(n)])
    bits = WIDTH_BITS[dtype] * n
    return bytes((i * 37) & 0xFF for i in range((bits + 7) // 8))


def frame(header, data=b"", length=None):
    """8-byte little-endian length, header bytes, data. A header whose length is 123 modulo 256
    gets one more space (the harness reads inputs starting with '{' as header-first)."""
    if isinstance(header, str):
        header = header.encode("utf-8")
    if length is None:
        if len(header) % 256 == 123:
            header += b" "
        length = len(header)
    return struct.pack("<Q", length) + header + data


def safetensors(tensors, metadata="pt", pad=True):
    """A valid file: tensors is a list of (name, dtype, shape); metadata a dict, "pt" for
    {"format": "pt"}, or None for none. The header is padded with spaces to a multiple of 8,
    as the reference writer does."""
    header = {}
    if metadata == "pt":
        header["__metadata__"] = {"format": "pt"}
    elif metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    for name, dtype, shape in tensors:
        b = values_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if pad:
        text += b" " * (-(len(text) + 8) % 8)
    return frame(text, data)


def entry(name, dtype, shape, offsets):
    return '"%s":{"dtype":%s,"shape":%s,"data_offsets":%s}' % (name, dtype, shape, offsets)


def st_raw(entries, data, metadata=None):
    """A file from hand-written header entries (JSON text), for the malformed ones."""
    parts = ([metadata] if metadata else []) + entries
    return frame("{" + ",".join(parts) + "}", data)


def nested(depth, leaf="1", open_="[", close="]"):
    return open_ * depth + leaf + close * depth


def nested_objects(depth, leaf="1"):
    return '{"a":' * depth + leaf + "}" * depth


def safetensors_seeds():
    s = {}
    w8 = values_bytes("F32", [2])  # 8 bytes
    # Valid files.
    s["valid_f32.safetensors"] = safetensors([("w", "F32", [2, 3])])
    s["valid_dtypes.safetensors"] = safetensors(
        [("f32", "F32", [2, 2]), ("f64", "F64", [3]), ("bf16", "BF16", [2, 2]), ("f16", "F16", [4]),
         ("i32", "I32", [2]), ("i64", "I64", [1]), ("u8", "U8", [3]), ("bool", "BOOL", [2]),
         ("fp8", "F8_E4M3", [2]), ("fp4", "F4", [4]), ("c64", "C64", [1])])
    s["valid_zero_size.safetensors"] = safetensors(
        [("empty", "F32", [0]), ("rows0", "F32", [3, 0]), ("cols0", "BF16", [0, 5]), ("scalar", "F32", []),
         ("after", "F64", [1])])
    s["valid_scalar_only.safetensors"] = safetensors([("s", "F64", [])], metadata=None)
    s["valid_4d.safetensors"] = safetensors([("t", "F16", [2, 1, 3, 2])])
    s["valid_unpadded.safetensors"] = safetensors([("w", "BF16", [3])], pad=False)
    s["valid_metadata.safetensors"] = safetensors(
        [("w", "F32", [2])], metadata={"format": "pt", "note": "caf\u00e9 \u2713", "empty": ""})
    s["valid_metadata_only.safetensors"] = safetensors([])
    s["valid_no_metadata.safetensors"] = safetensors([("w", "F64", [2, 1])], metadata=None)
    s["empty_header.safetensors"] = frame("{}")
    s["empty_header_padded.safetensors"] = frame("{}      ")
    s["layer_f32.safetensors"] = safetensors(
        [("q_proj.weight", "F32", [8, 8]), ("k_proj.weight", "F32", [4, 8]), ("v_proj.weight", "F32", [4, 8]),
         ("o_proj.weight", "F32", [8, 8]), ("gate_proj.weight", "F32", [8, 8])])
    s["layer_mixed_dtypes.safetensors"] = safetensors(
        [("q_proj.weight", "BF16", [8, 8]), ("k_proj.weight", "F16", [4, 8]), ("v_proj.weight", "F64", [4, 8]),
         ("o_proj.weight", "F32", [8, 8]), ("gate_proj.weight", "I32", [8, 8])])
    s["layer_wrong_shape.safetensors"] = safetensors(
        [("q_proj.weight", "F32", [16, 8]), ("k_proj.weight", "F32", [4, 8]), ("v_proj.weight", "F32", [32]),
         ("o_proj.weight", "F32", [8, 8])])
    # Header-first inputs (the harness writes the length): header JSON, NUL, data.
    hdr = '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]}}'
    s["header_first_valid"] = hdr.encode() + b"\0" + w8 + values_bytes("BF16", [2, 2])
    s["header_first_truncated"] = hdr.encode() + b"\0" + w8
    s["header_first_no_data"] = b'{"__metadata__":{"format":"pt"}}'
    # Metadata.
    a = entry("w", '"F32"', "[2]", "[0,8]")
    s["metadata_null.safetensors"] = st_raw([a], w8, '"__metadata__":null')
    s["metadata_not_object.safetensors"] = st_raw([a], w8, '"__metadata__":3')
    s["metadata_non_string.safetensors"] = st_raw([a], w8, '"__metadata__":{"n":1,"l":[1,2],"o":{"x":"y"}}')
    s["metadata_twice.safetensors"] = st_raw([a, '"__metadata__":{"b":"2"}'], w8, '"__metadata__":{"a":"1"}')
    # Truncation and lengths.
    s["truncated_data.safetensors"] = safetensors([("w", "F32", [4])])[:-8]
    s["truncated_header.safetensors"] = frame('{"w":{"dtype":"F32"', length=100)
    s["short_file.safetensors"] = b"\x02\x00\x00"
    s["length_only.safetensors"] = struct.pack("<Q", 0)
    s["header_length_huge.safetensors"] = frame("{}", length=0x7F7F7F7F7F7F7F7F)
    s["header_length_over_limit.safetensors"] = frame("{}", length=100_000_001)
    s["header_length_u64_max.safetensors"] = frame("{}", length=2**64 - 1)
    # Offsets.
    s["offsets_out_of_range.safetensors"] = st_raw([entry("w", '"F32"', "[2]", "[0,1099511627776]")], w8)
    s["offsets_reversed.safetensors"] = st_raw([entry("w", '"F32"', "[2]", "[8,0]")], w8)
    s["offsets_overlap.safetensors"] = st_raw(
        [entry("a", '"F32"', "[2]", "[0,8]"), entry("b", '"F32"', "[2]", "[4,12]")], w8 + w8[:4])
    s["offsets_same.safetensors"] = st_raw([entry("a", '"F32"', "[2]", "[0,8]"), entry("b", '"F32"', "[2]", "[0,8]")], w8)
    s["offsets_gap.safetensors"] = st_raw([entry("w", '"F32"', "[1]", "[4,8]")], w8)
    s["offsets_trailing_bytes.safetensors"] = st_raw([entry("w", '"F32"', "[1]", "[0,4]")], w8)
    s["offsets_three.safetensors"] = st_raw([entry("w", '"F32"', "[2]", "[0,4,8]")], w8)
    s["offsets_one.safetensors"] = st_raw([entry("w", '"F32"', "[2]", "[8]")], w8)
    s["offsets_strings.safetensors"] = st_raw([entry("w", '"F32"', "[2]", '["0","8"]')], w8)
    s["offsets_float.safetensors"] = st_raw([entry("w", '"F32"', "[2]", "[0.0,8.0]")], w8)
    s["offsets_exponent.safetensors"] = st_raw([entry("w", '"F32"', "[2]", "[0,8e0]")], w8)
    s["offsets_negative.safetensors"] = st_raw([entry("w", '"F32"', "[2]", "[-8,0]")], w8)
    s["offsets_u64_max.safetensors"] = st_raw(
        [entry("w", '"F32"', "[2]", "[18446744073709551615,18446744073709551615]")], w8)
    s["offsets_beyond_u64.safetensors"] = st_raw([entry("w", '"F32"', "[2]", "[0,18446744073709551624]")], w8)
    # Dtypes and sizes.
    s["dtype_unknown.safetensors"] = st_raw([entry("w", '"Q4"', "[2]", "[0,8]")], w8)
    s["dtype_lowercase.safetensors"] = st_raw([entry("w", '"f32"', "[2]", "[0,8]")], w8)
    s["dtype_number.safetensors"] = st_raw([entry("w", "32", "[2]", "[0,8]")], w8)
    s["dtype_null.safetensors"] = st_raw([entry("w", "null", "[2]", "[0,8]")], w8)
    s["dtype_wrong_width.safetensors"] = st_raw([entry("w", '"F64"', "[2]", "[0,8]")], w8)
    s["dtype_f4_odd.safetensors"] = st_raw([entry("p", '"F4"', "[3]", "[0,2]")], w8[:2])
    s["dtype_f6.safetensors"] = st_raw([entry("p", '"F6_E2M3"', "[4]", "[0,3]")], w8[:3])
    s["size_mismatch.safetensors"] = st_raw([entry("w", '"F32"', "[3]", "[0,8]")], w8)
    # Shapes.
    s["shape_2p40_beyond_file.safetensors"] = st_raw([entry("w", '"F32"', "[1099511627776]", "[0,4398046511104]")], w8)
    s["shape_2p40_in_file.safetensors"] = st_raw([entry("w", '"F32"', "[1099511627776]", "[0,8]")], w8)
    s["shape_product_overflow.safetensors"] = st_raw(
        [entry("w", '"F32"', "[4294967296,4294967296,4294967296]", "[0,8]")], w8)
    s["shape_u64_max.safetensors"] = st_raw([entry("w", '"F32"', "[18446744073709551615]", "[0,8]")], w8)
    s["shape_zero_then_huge.safetensors"] = st_raw(
        [entry("w", '"F32"', "[0,281474976710656,281474976710656]", "[0,0]"), entry("v", '"F32"', "[2]", "[0,8]")], w8)
    s["shape_huge_then_zero.safetensors"] = st_raw(
        [entry("w", '"F32"', "[281474976710656,0]", "[0,0]"), entry("v", '"F32"', "[2]", "[0,8]")], w8)
    s["shape_negative.safetensors"] = st_raw([entry("w", '"F32"', "[-2]", "[0,8]")], w8)
    s["shape_negative_pair.safetensors"] = st_raw([entry("w", '"F32"', "[-1,-2]", "[0,8]")], w8)
    s["shape_float.safetensors"] = st_raw([entry("w", '"F32"', "[2.0]", "[0,8]")], w8)
    s["shape_not_array.safetensors"] = st_raw([entry("w", '"F32"', "2", "[0,8]")], w8)
    s["shape_nested.safetensors"] = st_raw([entry("w", '"F32"', "[[2]]", "[0,8]")], w8)
    s["shape_many_dims.safetensors"] = st_raw([entry("w", '"F32"', "[" + ",".join(["1"] * 300) + ",2]", "[0,8]")], w8)
    # Entries.
    s["entry_not_object.safetensors"] = st_raw(['"w":[1,2]'], w8)
    s["entry_missing_field.safetensors"] = st_raw(['"w":{"dtype":"F32","shape":[2]}'], w8)
    s["entry_extra_field.safetensors"] = st_raw(['"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}'], w8)
    s["entry_empty_name.safetensors"] = st_raw([entry("", '"F32"', "[2]", "[0,8]")], w8)
    # Duplicated names and keys (the reference reader refuses them).
    s["duplicate_name_same.safetensors"] = st_raw([a, a], w8)
    s["duplicate_name_other_dtype.safetensors"] = st_raw([a, entry("w", '"I32"', "[2]", "[0,8]")], w8)
    s["duplicate_name_two_spans.safetensors"] = st_raw(
        [entry("w", '"F32"', "[2]", "[0,8]"), entry("w", '"F32"', "[2]", "[8,16]")], w8 + w8)
    s["duplicate_field.safetensors"] = st_raw(['"w":{"dtype":"F64","dtype":"F32","shape":[2],"data_offsets":[0,8]}'], w8)
    s["duplicate_metadata_key.safetensors"] = st_raw([a], w8, '"__metadata__":{"k":"1","k":"2"}')
    # Nesting.
    s["deep_array_in_entry.safetensors"] = st_raw(['"w":' + nested(3000)], w8)
    s["deep_shape.safetensors"] = st_raw([entry("w", '"F32"', nested(3000, "2"), "[0,8]")], w8)
    s["deep_metadata.safetensors"] = st_raw([a], w8, '"__metadata__":' + nested_objects(2000, '"x"'))
    s["deep_header.safetensors"] = frame(nested(5000))
    # Text.
    s["header_not_object_array.safetensors"] = frame("[]")
    s["header_not_object_null.safetensors"] = frame("null")
    s["header_not_object_string.safetensors"] = frame('"w"')
    s["header_trailing_garbage.safetensors"] = frame("{} x")
    s["header_empty.safetensors"] = frame("")
    s["header_bom.safetensors"] = frame("\ufeff{}")
    s["header_nul_in_name.safetensors"] = st_raw([entry("w\\u0000x", '"F32"', "[2]", "[0,8]")], w8)
    s["header_escaped_names.safetensors"] = st_raw(
        [entry("caf\\u00e9", '"F32"', "[1]", "[0,4]"), entry("\\ud83d\\ude00", '"F32"', "[1]", "[4,8]")], w8)
    s["header_lone_surrogate.safetensors"] = st_raw([entry("\\ud800", '"F32"', "[2]", "[0,8]")], w8)
    s["header_nan.safetensors"] = st_raw([entry("w", '"F32"', "[NaN]", "[0,8]")], w8)
    bad = b'{"w\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    s["bad_utf8_name.safetensors"] = frame(bad, w8)
    s["bad_utf8_overlong.safetensors"] = frame(bad.replace(b"\xff", b"\xc0\xaf"), w8)
    s["bad_utf8_truncated_sequence.safetensors"] = frame(bad.replace(b"\xff", b"\xe2\x82"), w8)
    s["bad_utf8_metadata.safetensors"] = frame(b'{"__metadata__":{"k":"\xed\xa0\x80"}}')
    return s


# ---------------------------------------------------------------------------------------------
# config.json

def dump(obj):
    return json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8") + b"\n"


def config_seeds():
    s = {}
    with open(os.path.join(ROOT, "tests", "data", "qwen3_next", "config.json"), "rb") as f:
        real = f.read()
    base = json.loads(real)
    s["valid_qwen3_next.json"] = real

    def variant(**changes):
        c = dict(base)
        for k, v in changes.items():
            if v is KeyError:
                c.pop(k, None)
            else:
                c[k] = v
        return dump(c)

    minimal = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "partial_rotary_factor": 0.25}
    s["valid_minimal.json"] = dump(minimal)
    s["valid_compact.json"] = json.dumps(minimal, separators=(",", ":")).encode()
    s["valid_interval_only.json"] = variant(layer_types=KeyError)
    s["valid_bias_ungated.json"] = variant(attention_bias=True, attn_output_gate=False)
    s["valid_head_dim_null.json"] = variant(head_dim=None, hidden_size=1024, num_attention_heads=4)
    s["valid_qwen35_text_config.json"] = dump({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "vision_config": {"depth": 2, "hidden_size": 32},
        "text_config": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                        "num_hidden_layers": 4, "rms_norm_eps": 1e-6, "attn_output_gate": True,
                        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                            "mrope_interleaved": True}}})
    s["valid_rope_mrope.json"] = variant(rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
    # RoPE scaling gattn does not apply, and malformed RoPE fields.
    s["rope_yarn.json"] = variant(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    s["rope_parameters_linear.json"] = variant(rope_parameters={"rope_type": "linear", "factor": 2.0})
    s["rope_type_number.json"] = variant(rope_scaling={"rope_type": 1})
    s["rope_scaling_string.json"] = variant(rope_scaling="yarn")
    s["rope_parameters_array.json"] = variant(rope_parameters=[1, 2])
    s["rope_theta_string.json"] = variant(rope_theta="10000")
    s["rope_theta_zero.json"] = variant(rope_theta=0)
    s["rope_theta_negative.json"] = variant(rope_theta=-1.0)
    s["rms_norm_eps_negative.json"] = variant(rms_norm_eps=-1e-6)
    # Sizes.
    s["size_float.json"] = variant(hidden_size=64.5)
    s["size_float_integral.json"] = variant(head_dim=32.0)
    s["size_exponent.json"] = variant(hidden_size=1e30)
    s["size_negative.json"] = variant(num_attention_heads=-4)
    s["size_zero.json"] = variant(num_key_value_heads=0)
    s["size_string.json"] = variant(hidden_size="64")
    s["size_bool.json"] = variant(head_dim=True)
    s["size_i64_max.json"] = variant(hidden_size=2**63 - 1)
    s["size_u64_max.json"] = variant(hidden_size=2**64 - 1)
    s["size_beyond_u64.json"] = variant(hidden_size=2**64 + 8)
    s["size_2p24_plus_1.json"] = variant(head_dim=2**24 + 1)
    s["size_i64_min.json"] = variant(num_key_value_heads=-2**63)
    s["missing_hidden_size.json"] = variant(hidden_size=KeyError)
    s["heads_not_divisible.json"] = variant(num_key_value_heads=3)
    # partial_rotary_factor.
    s["rotary_huge.json"] = variant(partial_rotary_factor=1e300)
    s["rotary_large.json"] = variant(partial_rotary_factor=3.0e18)
    s["rotary_zero.json"] = variant(partial_rotary_factor=0)
    s["rotary_negative.json"] = variant(partial_rotary_factor=-0.5)
    s["rotary_above_one.json"] = variant(partial_rotary_factor=2)
    s["rotary_too_small.json"] = variant(partial_rotary_factor=0.01)
    s["rotary_odd.json"] = variant(partial_rotary_factor=0.09375)
    # Booleans and layers.
    s["bias_string.json"] = variant(attention_bias="yes")
    s["gate_number.json"] = variant(attn_output_gate=1)
    s["interval_zero.json"] = variant(layer_types=KeyError, full_attention_interval=0)
    s["interval_negative.json"] = variant(layer_types=KeyError, full_attention_interval=-4)
    s["interval_huge.json"] = variant(layer_types=KeyError, full_attention_interval=2**62)
    s["interval_i64_max.json"] = variant(layer_types=KeyError, num_hidden_layers=KeyError,
                                         full_attention_interval=2**63 - 1)
    s["layers_zero.json"] = variant(num_hidden_layers=0)
    s["layers_huge.json"] = variant(num_hidden_layers=2**63 - 1, layer_types=KeyError)
    s["layer_types_short.json"] = variant(layer_types=["full_attention"])
    s["layer_types_not_array.json"] = variant(layer_types="full_attention")
    s["layer_types_numbers.json"] = variant(layer_types=[0, 1, 2, 3])
    s["layer_types_null.json"] = variant(layer_types=None)
    s["text_config_not_object.json"] = variant(text_config=[1])
    s["text_config_empty.json"] = variant(text_config={})
    # Text.
    s["duplicate_keys.json"] = b'{"hidden_size": 64, "hidden_size": 32, "num_attention_heads": 4, ' \
                               b'"num_key_value_heads": 2, "head_dim": 32}'
    s["deep_array.json"] = ('{"hidden_size": ' + nested(3000) + "}").encode()
    s["deep_text_config.json"] = ('{"text_config": ' + nested_objects(3000) + "}").encode()
    s["deep_rope.json"] = ('{"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, '
                           '"rope_scaling": {"type": ' + nested(3000) + "}}").encode()
    s["empty.json"] = b""
    s["null.json"] = b"null"
    s["array.json"] = b"[]"
    s["number.json"] = b"1"
    s["unterminated.json"] = b'{"hidden_size": 64'
    s["trailing_garbage.json"] = b'{"hidden_size": 64} x'
    s["comment.json"] = b'{/* c */"hidden_size": 64}'
    s["bom.json"] = b"\xef\xbb\xbf" + dump(minimal)
    s["bad_utf8_key.json"] = b'{"hidden_size\xff": 64}'
    s["bad_utf8_value.json"] = b'{"model_type": "\xc0\xaf", "hidden_size": 64}'
    s["lone_surrogate.json"] = b'{"model_type": "\\udc00"}'
    s["nan.json"] = b'{"rope_theta": NaN}'
    return s


# ---------------------------------------------------------------------------------------------
# model.safetensors.index.json (fuzz_index.cpp writes the shards these name)

L0 = "model.layers.0.self_attn."
L35 = "model.language_model.layers.0.self_attn."
NAMES = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight"]
SHARD = {"q_proj.weight": 1, "k_proj.weight": 1, "q_norm.weight": 1,
         "v_proj.weight": 2, "o_proj.weight": 2, "k_norm.weight": 2}


def index(weight_map, metadata=None):
    return dump({"metadata": metadata if metadata is not None else {"total_size": 1184}, "weight_map": weight_map})


def sharded(**override):
    m = {L0 + n: "model-%05d-of-00002.safetensors" % SHARD[n] for n in NAMES}
    m["model.layers.1.self_attn.q_proj.weight"] = "model-00002-of-00002.safetensors"
    for n, v in override.items():
        m[L0 + n.replace("_weight", ".weight")] = v
    return m


def index_seeds():
    s = {}
    s["valid_sharded.json"] = index(sharded())
    s["valid_subdirectory.json"] = index({L0 + n: "sub/all.safetensors" for n in NAMES})
    s["valid_qwen35.json"] = index({L35 + n: "qwen35.safetensors" for n in NAMES})
    s["valid_mixed.json"] = index(sharded(v_proj_weight="sub/all.safetensors", q_norm_weight="sub/all.safetensors"))
    s["valid_no_metadata.json"] = json.dumps({"weight_map": sharded()}).encode()
    s["valid_dot_segment.json"] = index({L0 + n: "./sub/all.safetensors" for n in NAMES})
    s["value_dot_dot_inside.json"] = index({L0 + n: "sub/../sub/all.safetensors" for n in NAMES})
    s["missing_weight_map.json"] = dump({"metadata": {"total_size": 0}})
    s["weight_map_array.json"] = dump({"weight_map": [L0 + "q_proj.weight"]})
    s["weight_map_null.json"] = dump({"weight_map": None})
    s["weight_map_empty.json"] = index({})
    s["value_number.json"] = index(sharded(q_proj_weight=1))
    s["value_null.json"] = index(sharded(k_proj_weight=None))
    s["value_object.json"] = index(sharded(k_proj_weight={"file": "model-00001-of-00002.safetensors"}))
    s["value_empty.json"] = index(sharded(q_proj_weight=""))
    s["value_directory.json"] = index(sharded(q_proj_weight="sub"))
    s["value_dot.json"] = index(sharded(q_proj_weight="."))
    s["value_root.json"] = index(sharded(q_proj_weight="/"))
    s["value_absolute.json"] = index(sharded(q_proj_weight="/nonexistent/gattn/model.safetensors"))
    s["value_parent.json"] = index(sharded(q_proj_weight="../checkpoint/model-00001-of-00002.safetensors"))
    s["value_nul.json"] = index(sharded(q_proj_weight="model-00001-of-00002.safetensors\u0000.txt"))
    s["value_missing_file.json"] = index(sharded(o_proj_weight="model-00003-of-00003.safetensors"))
    s["value_broken_shard.json"] = index(sharded(o_proj_weight="broken.safetensors"))
    s["value_config.json"] = index(sharded(o_proj_weight="config.json"))
    s["value_index_itself.json"] = index(sharded(o_proj_weight="model.safetensors.index.json"))
    s["tensor_not_in_shard.json"] = index(sharded(q_proj_weight="model-00002-of-00002.safetensors"))
    s["mismatched_q_proj.json"] = index(sharded(q_proj_weight="mismatched.safetensors"))
    s["mismatched_dtype.json"] = index(sharded(k_proj_weight="mismatched.safetensors"))
    s["mismatched_rank.json"] = index(sharded(v_proj_weight="mismatched.safetensors"))
    s["mismatched_norm_dtype.json"] = index(sharded(q_norm_weight="mismatched.safetensors"))
    s["missing_tensor.json"] = index({k: v for k, v in sharded().items() if not k.endswith("k_norm.weight")})
    s["metadata_odd.json"] = index(sharded(), metadata={"total_size": -1, "nested": [[[]]]})
    pairs = [(L0 + "q_proj.weight", "broken.safetensors")] + list(sharded().items())  # the last one counts
    s["duplicate_keys.json"] = ("{\"weight_map\": {" + ", ".join('"%s": "%s"' % p for p in pairs) + "}}").encode()
    s["deep_value.json"] = ('{"weight_map": {"' + L0 + 'q_proj.weight": ' + nested(3000) + "}}").encode()
    s["deep_metadata.json"] = ('{"metadata": ' + nested_objects(3000) + ', "weight_map": {}}').encode()
    s["not_object.json"] = b"[]"
    s["empty.json"] = b""
    s["bad_utf8_value.json"] = b'{"weight_map": {"model.layers.0.self_attn.q_proj.weight": "model-00001\xff.safetensors"}}'
    s["bad_utf8_key.json"] = b'{"weight_map": {"model.layers.0.self_attn.q_proj.weight\xc0": "sub/all.safetensors"}}'
    return s


# ---------------------------------------------------------------------------------------------
# fuzz_sdpa's decoding mode (run_decode in tests/fuzz/fuzz_sdpa.cpp reads these bytes in order)

DECODE_MODE = 7  # first byte, modulo 8


def decode_input(spec, d_model, heads, kv_index, head_dim, bits, int8, batch, capacity, steps,
                 window=None, softcap_small=None, zero_centred=None, rotary_half=None, seed=5):
    """One decoding input. Sizes are given as the harness reads them (in.range(lo, hi) takes
    lo + byte % (hi - lo + 1)); value_head_dim = head_dim. bits: 1 qkv_bias, 2 o_bias, 4 sinks,
    8 window, 16 softcap, 32 q/k norm, 64 RoPE, 128 ALiBi. steps: (op, a, b, c) bytes each, op
    mod 8: 0-3 forward of 1 + a % 4 slots per sequence with counts from b's bit pairs, 4 rollback,
    5 an invalid call of kind a % 11, 6 an invalid truncation of kind a % 3, 7 clear. The
    values then come from the harness's generator."""
    b = [DECODE_MODE, spec, d_model - 1, heads - 1, kv_index, head_dim - 1, 1, bits]
    if bits & 8:
        b.append(window - 1)
    if bits & 16:
        b.append(1 if softcap_small else 0)
    if bits & 32:
        b.append(1 if zero_centred else 0)
    if bits & 64 and head_dim >= 2:
        b.append(rotary_half - 1)
    b += [1 if int8 else 0, batch - 1, capacity - 1, seed, len(steps) - 1]
    for step in steps:
        b += list(step)
    return bytes(b)


def decode_seeds():
    def fwd(n, counts):  # n slots per sequence (1-4), counts of new tokens (0-3 each)
        assert 1 <= n <= 4 and all(0 <= c <= min(n, 3) for c in counts)
        return (0, n - 1, sum(c << (2 * i) for i, c in enumerate(counts)), 0)

    bad = lambda kind, n=2, which=0: (5, kind, n - 1, which)
    bad_truncate = lambda kind, extra=0, which=0: (6, kind, extra, which)
    rollback = lambda a: (4, a, 0, 0)
    s = {}
    # G1 gate with sinks on a float cache: prefill, decode, a rollback, invalid counts, decode.
    s["decode_float_g1_sinks"] = decode_input(
        1, 16, 4, 1, 4, 4, False, 2, 12,
        [fwd(4, [3, 2]), fwd(1, [1, 1]), rollback(3), bad(1), bad(2, 1, 1), bad_truncate(1, 2, 1), fwd(2, [2, 1])])
    # An int8 cache: a NaN key refused mid-decoding, shapes refused, then more tokens.
    s["decode_int8_nan_key"] = decode_input(
        2, 8, 2, 0, 8, 0, True, 2, 16,
        [fwd(3, [3, 1]), bad(7, 2, 1), bad(3), bad(4), bad(5), fwd(2, [2, 2]), bad(7, 1, 0), fwd(1, [1, 0])])
    # A window cache (window 2 of 10 rows: 4 rows kept) past its rows: dropped tokens, a
    # rollback to the minimum, truncations below it refused.
    s["decode_window_rollback"] = decode_input(
        3, 12, 2, 1, 4, 8 | 4, False, 2, 10,
        [fwd(4, [3, 3]), fwd(4, [3, 2]), fwd(2, [2, 2]), rollback(0), bad_truncate(2, 0, 1), bad_truncate(0),
         fwd(3, [1, 3]), bad(6)], window=2)
    # Every kind of invalid call between valid ones, float cache without a window.
    s["decode_invalid_calls"] = decode_input(
        0, 6, 3, 0, 2, 0, False, 3, 5,
        [fwd(2, [2, 1, 0]), bad(0), bad(6, 3), bad(8), bad(9), bad(10), bad_truncate(1, 0, 2), fwd(1, [1, 1, 1])])
    # Softcap, ALiBi, zero-centred q/k norm and RoPE on an int8 cache; clear, then again.
    s["decode_int8_softcap_alibi_rope"] = decode_input(
        1, 16, 4, 2, 8, 16 | 32 | 64 | 128 | 1 | 2, True, 1, 20,
        [fwd(4, [3]), fwd(1, [1]), bad(10), (7, 0, 0, 0), fwd(3, [2]), bad(7, 3, 0), rollback(1), fwd(2, [2])],
        softcap_small=True, zero_centred=True, rotary_half=2)
    # The same options on a float cache, against the float64 reference.
    s["decode_float_softcap_alibi_rope"] = decode_input(
        5, 16, 4, 1, 8, 16 | 32 | 64 | 128 | 4, False, 2, 20,
        [fwd(4, [3, 3]), fwd(1, [1, 1]), fwd(2, [0, 2]), bad(1), rollback(2), fwd(3, [3, 1])],
        softcap_small=False, zero_centred=False, rotary_half=4)
    return s


def main():
    check = "--check" in sys.argv[1:]
    differ = []
    for sub, seeds in (("corpus_safetensors", safetensors_seeds()), ("corpus_config", config_seeds()),
                       ("corpus_index", index_seeds()), ("corpus", decode_seeds())):
        d = os.path.join(FUZZ, sub)
        os.makedirs(d, exist_ok=True)
        for name, content in sorted(seeds.items()):
            path = os.path.join(d, name)
            if check:
                try:
                    with open(path, "rb") as f:
                        same = f.read() == content
                except OSError:
                    same = False
                if not same:
                    differ.append(path)
            else:
                with open(path, "wb") as f:
                    f.write(content)
        files = os.listdir(d)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in files)
        print("%s: %d files, %d KiB" % (os.path.relpath(d, ROOT), len(files), (size + 1023) // 1024))
    if differ:
        print("differ from the script's output:\n  " + "\n  ".join(differ), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
