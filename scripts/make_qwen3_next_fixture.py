#!/usr/bin/python3
"""Generate the Qwen3-Next full-attention fixture in tests/data/qwen3_next/.

The directory mimics a (tiny) Hugging Face checkpoint: config.json with
Hugging Face's key names, model.safetensors with the weights of the one
full-attention layer (layer 3) under their Hugging Face names, and
cases.safetensors with batched prefill/decode/chunk inputs and the layer's
float64 reference outputs.

Conventions (transformers' Qwen3NextAttention), per sequence of N tokens,
D = hidden_size, H query heads, Hkv KV heads, head_dim d:
  * Weights use the nn.Linear layout W[out, in]: y = x @ W.T (no biases).
  * q_proj has H*2*d rows, fused per head: q_proj(x).view(N, H, 2d).chunk(2, -1)
    gives query [N, H, d] (rows [h*2d, h*2d+d)) and gate logits [N, H, d]
    (rows [h*2d+d, (h+1)*2d)); the gate is reshaped to [N, H*d].
  * Zero-centred RMSNorm over head_dim, applied per head to the query (never
    to the gate) and to the key: y = x * rsqrt(mean(x^2) + eps) * (1 + w).
    The value has no norm.
  * Partial NeoX RoPE after the norms: rotary_dim r = int(d * partial_rotary_factor);
    inv_freq = theta^(-arange(0, r, 2) / r); emb = cat(pos * inv_freq, pos * inv_freq);
    x[:r] <- x[:r] * cos(emb) + rotate_half(x[:r]) * sin(emb) with
    rotate_half(x) = cat(-x[r/2:], x[:r/2]); dims [r, d) pass through.
  * GQA: query head h reads KV head h // (H / Hkv). Scores are scaled by
    1/sqrt(head_dim) (not 1/sqrt(D/H)); causal by position; softmax over keys.
  * out = attention [N, H*d] (head-major) * sigmoid(gate); y = out @ o_proj.T.

The reference is computed in float64 from exactly the stored float32/bf16
values, one sequence at a time, recomputing the whole sequence at every step
(no KV cache): a decode or chunk step's expected output is the output rows of
the new tokens when the layer runs over all of the sequence's valid tokens so
far. Padded prefill rows hold +-1e4 garbage and their expected outputs are 0.

After writing, the files are read back, checked byte for byte, and every
output is recomputed with a second, NumPy/loop-based path that must agree to
1e-12. Several plausible wrong implementations are then run through the same
cases and must differ from the reference by a clear margin.

Usage:
  python3 scripts/make_qwen3_next_fixture.py           # write tests/data/qwen3_next and check it
  python3 scripts/make_qwen3_next_fixture.py --check   # only check the existing files
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from safetensors_io import encode_safetensors, read_safetensors

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "tests" / "data" / "qwen3_next"
TOLERANCE = 1e-12
MIN_MARGIN = 1e-3  # a wrong variant must move some expected output by at least this
SEED = 3001
LAYER = 3
PREFIX = f"model.layers.{LAYER}.self_attn."
BF16_TENSOR = PREFIX + "k_norm.weight"
PAD_VALUE = 1.0e4

CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "partial_rotary_factor": 0.25,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                    "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "mlp_only_layers": [],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "transformers_version": "4.57.0",
}

BATCH = 2
PREFILL_LEN = 7
LENGTHS = [7, 5]
DECODE_STEPS = 3
CHUNK_LEN = 2


@dataclass(frozen=True)
class Dims:
    D: int
    H: int
    Hkv: int
    d: int
    rotary_dim: int
    theta: float
    eps: float

    @staticmethod
    def from_config(config):
        d = config["head_dim"]
        return Dims(D=config["hidden_size"], H=config["num_attention_heads"],
                    Hkv=config["num_key_value_heads"], d=d,
                    rotary_dim=int(d * config["partial_rotary_factor"]),
                    theta=float(config["rope_theta"]), eps=float(config["rms_norm_eps"]))


# ---------------------------------------------------------------------------
# Weights and inputs
# ---------------------------------------------------------------------------

def uniform(generator, shape, bound):
    """float32 values uniform in [-bound, bound)."""
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1) * bound


def make_weights(dims):
    """Layer-3 weights under their HF names: float32, except BF16_TENSOR (bfloat16)."""
    generator = torch.Generator().manual_seed(SEED)
    D, H, Hkv, d = dims.D, dims.H, dims.Hkv, dims.d
    in_bound = 1.0 / math.sqrt(D)
    out_bound = 1.0 / math.sqrt(H * d)
    weights = {
        PREFIX + "q_proj.weight": uniform(generator, (H * 2 * d, D), in_bound),
        PREFIX + "k_proj.weight": uniform(generator, (Hkv * d, D), in_bound),
        PREFIX + "v_proj.weight": uniform(generator, (Hkv * d, D), in_bound),
        PREFIX + "o_proj.weight": uniform(generator, (D, H * d), out_bound),
        PREFIX + "q_norm.weight": 0.1 * torch.randn((d,), generator=generator),
        PREFIX + "k_norm.weight": 0.1 * torch.randn((d,), generator=generator),
    }
    weights[BF16_TENSOR] = weights[BF16_TENSOR].to(torch.bfloat16)
    return weights


def make_steps(dims):
    """The cases: list of (name, hidden [B, n, D] f32, positions [B, n] i64, valid [B])."""
    generator = torch.Generator().manual_seed(SEED + 1)
    D = dims.D

    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    hidden = randn(BATCH, PREFILL_LEN, D)
    garbage = PAD_VALUE * torch.sign(randn(BATCH, PREFILL_LEN, D))
    for b, length in enumerate(LENGTHS):
        hidden[b, length:] = garbage[b, length:]
    positions = torch.arange(PREFILL_LEN, dtype=torch.int64).repeat(BATCH, 1)
    steps = [("prefill", hidden, positions, list(LENGTHS))]

    next_pos = list(LENGTHS)
    for s in range(DECODE_STEPS):
        positions = torch.tensor([[p] for p in next_pos], dtype=torch.int64)
        steps.append((f"decode.{s}", randn(BATCH, 1, D), positions, [1] * BATCH))
        next_pos = [p + 1 for p in next_pos]
    positions = torch.tensor([[p + i for i in range(CHUNK_LEN)] for p in next_pos],
                             dtype=torch.int64)
    steps.append(("chunk", randn(BATCH, CHUNK_LEN, D), positions, [CHUNK_LEN] * BATCH))
    return steps


# ---------------------------------------------------------------------------
# Reference forward pass (torch, float64, mirrors Qwen3NextAttention)
# ---------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    """Qwen3NextRMSNorm: zero-centred weight, normalised over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(positions, dims):
    r = dims.rotary_dim
    inv_freq = 1.0 / dims.theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [N, r/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, r]
    return emb.cos(), emb.sin()


def apply_partial_rope(x, cos, sin, r):
    """x [N, heads, d]; cos, sin [N, r]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def torch_attention(w, x, positions, dims):
    """One sequence: x [N, D] f64, positions [N] -> (output [N, D], gate [N, H*d])."""
    N = x.shape[0]
    H, Hkv, d = dims.H, dims.Hkv, dims.d
    query, gate = torch.chunk((x @ w["q_proj.weight"].t()).view(N, H, 2 * d), 2, dim=-1)
    gate = gate.reshape(N, H * d)
    query = rms_norm(query, w["q_norm.weight"], dims.eps)
    key = rms_norm((x @ w["k_proj.weight"].t()).view(N, Hkv, d), w["k_norm.weight"], dims.eps)
    value = (x @ w["v_proj.weight"].t()).view(N, Hkv, d)

    cos, sin = rope_cos_sin(positions, dims)
    query = apply_partial_rope(query, cos, sin, dims.rotary_dim)
    key = apply_partial_rope(key, cos, sin, dims.rotary_dim)

    group = H // Hkv
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    q, k, v = (z.transpose(0, 1) for z in (query, key, value))  # [H, N, d]
    scores = torch.matmul(q, k.transpose(-1, -2)) * dims.d ** -0.5
    allowed = positions[None, :] <= positions[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    attended = torch.matmul(probs, v).transpose(0, 1).reshape(N, H * d)
    gate_scores = torch.sigmoid(gate)
    output = (attended * gate_scores) @ w["o_proj.weight"].t()
    return output, gate_scores


def run_cases(steps, forward, D, gate_width):
    """Run every step with no cache; return the expected-output arrays (float64 numpy).

    steps: list of (name, hidden [B, n, D], positions [B, n], valid [B]) as numpy arrays.
    forward(x [N, D] f64, positions [N] i64, b) -> (output [N, D], gate [N, gate_width]).
    """
    contexts = [[] for _ in range(BATCH)]
    context_pos = [[] for _ in range(BATCH)]
    results = {}
    for name, hidden, positions, valid in steps:
        B, n, _ = hidden.shape
        output = np.zeros((B, n, D))
        gate = np.zeros((B, n, gate_width))
        for b in range(B):
            m = valid[b]
            contexts[b].append(np.asarray(hidden[b, :m], dtype=np.float64))
            context_pos[b].append(np.asarray(positions[b, :m], dtype=np.int64))
            x = np.concatenate(contexts[b])
            pos = np.concatenate(context_pos[b])
            y, g = forward(x, pos, b)
            output[b, :m] = np.asarray(y)[-m:]
            gate[b, :m] = np.asarray(g)[-m:]
        results[f"{name}.output"] = output
        if name == "prefill":
            results["prefill.gate"] = gate
    return results


def torch_reference(weights, steps, dims):
    w = {name[len(PREFIX):]: t.to(torch.float64) for name, t in weights.items()}

    def forward(x, pos, b):
        y, g = torch_attention(w, torch.from_numpy(x), torch.from_numpy(pos), dims)
        return y.numpy(), g.numpy()

    np_steps = [(n, h.numpy(), p.numpy(), v) for n, h, p, v in steps]
    return run_cases(np_steps, forward, dims.D, dims.H * dims.d)


# ---------------------------------------------------------------------------
# Second, independent forward pass (NumPy, explicit loops), with switches for
# the wrong variants it must be distinguishable from
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    split: str = "per_head"    # "per_head" | "flat" (first H*d rows query, rest gate)
    kv_head: str = "div"       # "div": h // group | "mod": h % Hkv
    rope: str = "half"         # "half" (NeoX) | "pairs" (2i, 2i+1) | "full" (all of d)
    norm_offset: float = 1.0   # 1.0: (1 + w); 0.0: plain w
    norm_gate: bool = False    # apply q_norm to the gate logits too
    scale: str = "head_dim"    # "head_dim": 1/sqrt(d) | "model": 1/sqrt(D/H)
    decode_pos_from_padded: bool = False  # new tokens numbered after the padded length
    keep_padding_in_cache: bool = False   # padded prefill rows stay in the KV cache


def numpy_attention(a, x, pos, dims, var):
    D, H, Hkv, d, r = dims.D, dims.H, dims.Hkv, dims.d, dims.rotary_dim
    N = x.shape[0]
    wq = a["q_proj.weight"]
    if var.split == "per_head":
        q_rows = [h * 2 * d + e for h in range(H) for e in range(d)]
        g_rows = [h * 2 * d + d + e for h in range(H) for e in range(d)]
    else:
        q_rows = list(range(H * d))
        g_rows = list(range(H * d, 2 * H * d))
    q = np.einsum("nc,oc->no", x, wq[q_rows]).reshape(N, H, d)
    g = np.einsum("nc,oc->no", x, wq[g_rows]).reshape(N, H, d)
    k = np.einsum("nc,oc->no", x, a["k_proj.weight"]).reshape(N, Hkv, d)
    v = np.einsum("nc,oc->no", x, a["v_proj.weight"]).reshape(N, Hkv, d)

    def norm(t, weight):
        out = np.empty_like(t)
        for i in range(t.shape[0]):
            for h in range(t.shape[1]):
                row = t[i, h]
                inv_rms = 1.0 / math.sqrt(float(np.dot(row, row)) / d + dims.eps)
                out[i, h] = row * inv_rms * (var.norm_offset + weight)
        return out

    q = norm(q, a["q_norm.weight"])
    k = norm(k, a["k_norm.weight"])
    if var.norm_gate:
        g = norm(g, a["q_norm.weight"])

    def rope(t):
        width = d if var.rope == "full" else r
        out = t.copy()
        for i in range(N):
            for j in range(width // 2):
                angle = float(pos[i]) * dims.theta ** (-2.0 * j / width)
                c, s = math.cos(angle), math.sin(angle)
                lo, hi = (2 * j, 2 * j + 1) if var.rope == "pairs" else (j, j + width // 2)
                x0, x1 = t[i, :, lo], t[i, :, hi]
                out[i, :, lo] = x0 * c - x1 * s
                out[i, :, hi] = x1 * c + x0 * s
        return out

    q, k = rope(q), rope(k)
    scale = 1.0 / math.sqrt(d if var.scale == "head_dim" else D // H)
    group = H // Hkv
    attended = np.zeros((N, H, d))
    for h in range(H):
        kv = h // group if var.kv_head == "div" else h % Hkv
        for i in range(N):
            keys = [j for j in range(N) if pos[j] <= pos[i]]
            logits = np.array([float(np.dot(q[i, h], k[j, kv])) * scale for j in keys])
            p = np.exp(logits - logits.max())
            p /= p.sum()
            attended[i, h] = sum(pj * v[j, kv] for pj, j in zip(p, keys))
    gate = 1.0 / (1.0 + np.exp(-g))
    output = np.einsum("nc,oc->no", (attended * gate).reshape(N, H * d), a["o_proj.weight"])
    return output, gate.reshape(N, H * d)


def numpy_cases(model_arrays, model_dtypes, cases, dims, var=Variant()):
    a = {name[len(PREFIX):]: to_float64(value, model_dtypes[name] == "BF16")
         for name, value in model_arrays.items()}
    steps = []
    for name in step_names():
        hidden = cases[f"{name}.hidden"]
        positions = cases[f"{name}.positions"].copy()
        valid = (list(cases["prefill.lengths"]) if name == "prefill"
                 else [hidden.shape[1]] * hidden.shape[0])
        if name == "prefill" and var.keep_padding_in_cache:
            valid = [hidden.shape[1]] * hidden.shape[0]
        if name != "prefill" and var.decode_pos_from_padded:
            padded_len = cases["prefill.hidden"].shape[1]
            positions = positions + (padded_len - cases["prefill.lengths"])[:, None]
        steps.append((name, hidden, positions, valid))

    def forward(x, pos, b):
        return numpy_attention(a, x, pos, dims, var)

    results = run_cases(steps, forward, dims.D, dims.H * dims.d)
    if var.keep_padding_in_cache:
        # The garbage rows were run as valid tokens; the expected zeros stay zeros.
        for b, length in enumerate(cases["prefill.lengths"]):
            results["prefill.output"][b, length:] = 0.0
            results["prefill.gate"][b, length:] = 0.0
    return results


WRONG_VARIANTS = [
    ("flat q/gate split of q_proj", Variant(split="flat")),
    ("GQA head h % Hkv", Variant(kv_head="mod")),
    ("interleaved-pair RoPE (2i, 2i+1)", Variant(rope="pairs")),
    ("RoPE over all of head_dim", Variant(rope="full")),
    ("norm weight w instead of 1 + w", Variant(norm_offset=0.0)),
    ("q_norm applied to the gate", Variant(norm_gate=True)),
    ("scale 1/sqrt(D/H) = 1/4", Variant(scale="model")),
    ("decode positions after padded length", Variant(decode_pos_from_padded=True)),
    ("padded rows kept in the KV cache", Variant(keep_padding_in_cache=True)),
]


# ---------------------------------------------------------------------------
# safetensors I/O
# ---------------------------------------------------------------------------

def bf16_bits(tensor):
    """Raw bit patterns of a torch.bfloat16 tensor as a little-endian uint16 array."""
    return tensor.view(torch.int16).numpy().view("<u2").copy()


def to_float64(array, is_bf16):
    if is_bf16:
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(array, dtype=np.float64)


# ---------------------------------------------------------------------------
# Build and check
# ---------------------------------------------------------------------------

def step_names():
    return ["prefill"] + [f"decode.{s}" for s in range(DECODE_STEPS)] + ["chunk"]


def cases_metadata():
    return {"layer": str(LAYER),
            "generator": f"scripts/make_qwen3_next_fixture.py, torch {torch.__version__}"}


def build(dims):
    weights = make_weights(dims)
    steps = make_steps(dims)
    expected = torch_reference(weights, steps, dims)

    model = {}
    for name, tensor in weights.items():
        model[name] = bf16_bits(tensor) if name == BF16_TENSOR else tensor.numpy().astype("<f4")

    cases = {}
    for name, hidden, positions, _ in steps:
        cases[f"{name}.hidden"] = hidden.numpy().astype("<f4")
        if name == "prefill":
            cases["prefill.lengths"] = np.array(LENGTHS, dtype="<i8")
        cases[f"{name}.positions"] = positions.numpy().astype("<i8")
        cases[f"{name}.output"] = expected[f"{name}.output"].astype("<f8")
        if name == "prefill":
            cases["prefill.gate"] = expected["prefill.gate"].astype("<f8")
    return (model, {"format": "pt"}), (cases, cases_metadata())


def max_abs_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def compare_bytes(path, arrays, metadata, expected):
    expected_arrays, expected_metadata = expected
    assert metadata == expected_metadata, f"{path}: metadata mismatch"
    assert list(arrays) == list(expected_arrays), f"{path}: tensor names mismatch"
    for name, array in expected_arrays.items():
        assert arrays[name].dtype == array.dtype, f"{path}: {name} dtype mismatch"
        assert arrays[name].tobytes() == array.tobytes(), f"{path}: {name} bytes differ"


def check(out_dir, built=None):
    config = json.loads((out_dir / "config.json").read_text())
    assert config == CONFIG, "config.json does not match the table in this script"
    dims = Dims.from_config(config)
    layer_types = config["layer_types"]
    assert layer_types[LAYER] == "full_attention"
    assert all((i + 1) % config["full_attention_interval"] == 0
               for i, t in enumerate(layer_types) if t == "full_attention")

    model_meta, model, model_dtypes = read_safetensors(out_dir / "model.safetensors")
    cases_meta, cases, _ = read_safetensors(out_dir / "cases.safetensors")
    if built is not None:
        compare_bytes("model.safetensors", model, model_meta, built[0])
        compare_bytes("cases.safetensors", cases, cases_meta, built[1])
    assert cases_meta["layer"] == str(LAYER)
    assert [n for n, t in model_dtypes.items() if t != "F32"] == [BF16_TENSOR]
    assert model_dtypes[BF16_TENSOR] == "BF16"
    D, H, Hkv, d = dims.D, dims.H, dims.Hkv, dims.d
    shapes = {"q_proj.weight": (H * 2 * d, D), "k_proj.weight": (Hkv * d, D),
              "v_proj.weight": (Hkv * d, D), "o_proj.weight": (D, H * d),
              "q_norm.weight": (d,), "k_norm.weight": (d,)}
    assert {PREFIX + n: s for n, s in shapes.items()} == \
        {n: tuple(a.shape) for n, a in model.items()}, "model tensor shapes"

    # Inputs: padding really is garbage, positions continue each sequence.
    lengths = cases["prefill.lengths"]
    assert list(lengths) == LENGTHS
    for b, length in enumerate(lengths):
        assert np.all(np.abs(cases["prefill.hidden"][b, length:]) == PAD_VALUE)
        assert np.all(cases["prefill.output"][b, length:] == 0.0)
        assert np.all(cases["prefill.gate"][b, length:] == 0.0)
    next_pos = lengths.copy()
    for name in step_names()[1:]:
        n = cases[f"{name}.hidden"].shape[1]
        assert np.array_equal(cases[f"{name}.positions"],
                              next_pos[:, None] + np.arange(n)[None, :]), name
        next_pos = next_pos + n

    reference = {name: cases[name] for name in cases
                 if name.endswith(".output") or name == "prefill.gate"}
    second = numpy_cases(model, model_dtypes, cases, dims)
    worst = max(max_abs_diff(second[name], reference[name]) for name in reference)
    if worst > TOLERANCE:
        raise AssertionError(f"second path disagrees with the stored outputs: {worst:.3e}")
    print(f"max |torch - numpy| over all outputs = {worst:.3e}")

    scale = max(float(np.max(np.abs(reference[n]))) for n in reference if n.endswith(".output"))
    print(f"max |reference output| = {scale:.4f}; wrong variants (max |variant - reference|):")
    for label, var in WRONG_VARIANTS:
        with np.errstate(over="ignore"):  # exp of garbage-row gate logits
            result = numpy_cases(model, model_dtypes, cases, dims, var)
        margin = max(max_abs_diff(result[n], reference[n]) for n in reference
                     if n.endswith(".output"))
        print(f"  {label:<40s} {margin:.4e}")
        if not margin > MIN_MARGIN:
            raise AssertionError(f"wrong variant '{label}' is too close: {margin:.3e}")
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only verify the existing files in tests/data/qwen3_next")
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR,
                        help="output directory (default: tests/data/qwen3_next)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # keep float64 reductions in a fixed order
    built = None
    if not args.check:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        built = build(Dims.from_config(CONFIG))
        (args.out_dir / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
        (args.out_dir / "model.safetensors").write_bytes(encode_safetensors(*built[0]))
        (args.out_dir / "cases.safetensors").write_bytes(encode_safetensors(*built[1]))
    check(args.out_dir, built)
    for name in ("config.json", "model.safetensors", "cases.safetensors"):
        print(f"{name}: {(args.out_dir / name).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
