#!/usr/bin/python3
"""Generate reference fixtures for the gattn gated-attention layer.

Each fixture is one .safetensors file in tests/data/ holding the weights and
input of a small attention layer (float32) plus the layer's output and some
intermediate values computed in float64 with an independent PyTorch
implementation.

Conventions (Gated Attention, arXiv:2505.06708, gate position G1):
  * Weights use the torch nn.Linear layout W[out, in]: y = x @ W.T + b.
  * Q = X Wq^T + bq -> [B, N, H, d]; K, V = X Wk^T + bk, X Wv^T + bv -> [B, N, Hkv, d].
  * Grouped-query attention: query head h reads KV head h // (H // Hkv).
  * scores = Q K^T / sqrt(d); the causal mask is bottom-right aligned
    (query i sees key j iff j <= i + N_k - N_q); softmax over keys.
  * U = P V -> [B, N, H*d], head-major (column h*d + e).
  * Gate: G = sigmoid(X Wg^T + bg); elementwise Wg is [H*d, D],
    headwise Wg is [H, D] (one scalar per head, broadcast over its d columns).
    Y = (U * G) Wo^T + bo.
  * Fused "per_head_interleaved" layout (Qwen3-Next): no gate_proj; q_proj has
    H*2*d rows, rows [h*2d, h*2d+d) are query head h and rows
    [h*2d+d, (h+1)*2d) are head h's elementwise gate logits.

Weights are drawn uniformly in +-1/sqrt(fan_in) and X ~ N(0, 1), all from a
fixed per-fixture seed and stored as float32; the reference is computed in
float64 from exactly those float32 values.

Stored tensors: q_proj/k_proj/v_proj/o_proj[/gate_proj].weight and any biases
(F32), input [B, N, D] (F32), output [B, N, D] (F64), gate_scores
[B, N, gate_width] (F64, gated layers only) and first_key_attention [B, N, H]
(F64, the probability each query puts on key 0).

The files are written with a small built-in safetensors writer. After writing,
every file is read back, checked byte for byte, and its outputs are recomputed
with a second, NumPy/einsum-based path that must agree to 1e-12.

Usage:
  python3 scripts/make_fixtures.py           # write tests/data/*.safetensors and check them
  python3 scripts/make_fixtures.py --check   # only check the existing files
"""

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from safetensors_io import DTYPES, encode_safetensors, read_safetensors

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "tests" / "data"
TOLERANCE = 1e-12
RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class FixtureConfig:
    name: str
    seed: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    seq_len: int
    causal: bool
    gate: str  # "none" | "g1_elementwise" | "g1_headwise"
    gate_layout: str  # "separate" | "per_head_interleaved"
    bias: bool  # q/k/v/o biases
    gate_bias: bool
    # Attention variants of current models (absent from the metadata when off):
    sinks: bool = False         # gpt-oss learned sinks, tensor "sinks" [H]
    sliding_window: int = 0     # gpt-oss / Mistral window in keys, counting the diagonal; 0 = none
    logit_softcap: float = 0.0  # Gemma 2 attn_logit_softcapping; 0 = none
    alibi: bool = False         # BLOOM ALiBi with its standard slopes
    qk_norm: str = ""           # "" | "rms" (Qwen3: y * w) | "zero_centred_rms" (Qwen3-Next: y * (1 + w))
    rotary_dim: int = 0         # RoPE on the first rotary_dim features of each head; 0 = none
    rope_style: str = "neox"    # "neox" (rotate_half, HF Llama) | "gptj" (interleaved pairs)
    rope_theta: float = 10000.0

    @property
    def gate_width(self):
        if self.gate == "g1_elementwise":
            return self.num_heads * self.head_dim
        if self.gate == "g1_headwise":
            return self.num_heads
        return 0

    @property
    def fused_gate(self):
        return self.gate_layout == "per_head_interleaved"


FIXTURES = [
    FixtureConfig("g1_elementwise_gqa_causal", seed=1001, d_model=64, num_heads=4,
                  num_kv_heads=2, head_dim=16, batch=2, seq_len=7, causal=True,
                  gate="g1_elementwise", gate_layout="separate", bias=True, gate_bias=True),
    FixtureConfig("g1_headwise", seed=1002, d_model=48, num_heads=4,
                  num_kv_heads=4, head_dim=12, batch=1, seq_len=5, causal=False,
                  gate="g1_headwise", gate_layout="separate", bias=False, gate_bias=False),
    FixtureConfig("g1_fused_interleaved_mqa_causal", seed=1003, d_model=32, num_heads=4,
                  num_kv_heads=1, head_dim=8, batch=2, seq_len=6, causal=True,
                  gate="g1_elementwise", gate_layout="per_head_interleaved",
                  bias=False, gate_bias=False),
    FixtureConfig("ungated_gqa_causal", seed=1004, d_model=64, num_heads=8,
                  num_kv_heads=2, head_dim=8, batch=1, seq_len=9, causal=True,
                  gate="none", gate_layout="separate", bias=False, gate_bias=False),
    FixtureConfig("demo_layer", seed=1005, d_model=256, num_heads=8,
                  num_kv_heads=2, head_dim=32, batch=1, seq_len=128, causal=True,
                  gate="g1_elementwise", gate_layout="separate", bias=False, gate_bias=False),
    # gpt-oss-style: learned sinks, a sliding window, biases, GQA.
    FixtureConfig("gpt_oss_sinks_window", seed=1006, d_model=64, num_heads=4,
                  num_kv_heads=2, head_dim=16, batch=2, seq_len=11, causal=True,
                  gate="none", gate_layout="separate", bias=True, gate_bias=False,
                  sinks=True, sliding_window=4),
    # Gemma-2-style logit softcap (a cap that bends these logits), beside a G1 gate.
    FixtureConfig("gemma2_softcap_gated", seed=1007, d_model=48, num_heads=4,
                  num_kv_heads=2, head_dim=12, batch=2, seq_len=9, causal=True,
                  gate="g1_elementwise", gate_layout="separate", bias=False, gate_bias=False,
                  logit_softcap=0.75),
    # Qwen3-style: q/k RMSNorm, full NeoX RoPE, beside a G1 gate (a Llama-style gated layer).
    FixtureConfig("qwen3_rope_qk_norm_gated", seed=1009, d_model=64, num_heads=4,
                  num_kv_heads=2, head_dim=16, batch=2, seq_len=9, causal=True,
                  gate="g1_elementwise", gate_layout="separate", bias=False, gate_bias=False,
                  qk_norm="rms", rotary_dim=16),
    # GPT-J-style interleaved partial RoPE (8 of 16 features), zero-centred q/k norm, base 100.
    FixtureConfig("gptj_partial_rope_headwise", seed=1010, d_model=48, num_heads=4,
                  num_kv_heads=1, head_dim=16, batch=1, seq_len=12, causal=True,
                  gate="g1_headwise", gate_layout="separate", bias=True, gate_bias=True,
                  qk_norm="zero_centred_rms", rotary_dim=8, rope_style="gptj", rope_theta=100.0),
    # BLOOM-style ALiBi, 6 heads (the slopes' non-power-of-two rule), MHA.
    FixtureConfig("bloom_alibi", seed=1008, d_model=48, num_heads=6,
                  num_kv_heads=6, head_dim=8, batch=1, seq_len=10, causal=True,
                  gate="none", gate_layout="separate", bias=True, gate_bias=False, alibi=True),
]


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------

def uniform(generator, shape, bound):
    """float32 values uniform in [-bound, bound)."""
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1) * bound


def make_tensors(cfg):
    """Draw the float32 weights, biases and input for one fixture (HF names)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    D, H, Hkv, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    in_bound = 1.0 / math.sqrt(D)
    out_bound = 1.0 / math.sqrt(H * d)

    q_rows = H * 2 * d if cfg.fused_gate else H * d
    weights = {
        "q_proj.weight": uniform(generator, (q_rows, D), in_bound),
        "k_proj.weight": uniform(generator, (Hkv * d, D), in_bound),
        "v_proj.weight": uniform(generator, (Hkv * d, D), in_bound),
        "o_proj.weight": uniform(generator, (D, H * d), out_bound),
    }
    separate_gate = cfg.gate != "none" and not cfg.fused_gate
    if separate_gate:
        weights["gate_proj.weight"] = uniform(generator, (cfg.gate_width, D), in_bound)
    if cfg.bias:
        weights["q_proj.bias"] = uniform(generator, (q_rows,), in_bound)
        weights["k_proj.bias"] = uniform(generator, (Hkv * d,), in_bound)
        weights["v_proj.bias"] = uniform(generator, (Hkv * d,), in_bound)
        weights["o_proj.bias"] = uniform(generator, (D,), out_bound)
    if cfg.gate_bias:
        if not separate_gate:
            raise ValueError(f"{cfg.name}: gate_bias needs a separate gate_proj")
        weights["gate_proj.bias"] = uniform(generator, (cfg.gate_width,), in_bound)
    weights["input"] = torch.randn((cfg.batch, cfg.seq_len, D), generator=generator,
                                   dtype=torch.float32)
    if cfg.sinks:
        weights["sinks"] = uniform(generator, (H,), 1.0) + 1.0  # in [0, 2)
    if cfg.qk_norm:  # around the identity scale: w near 1 (plain) or near 0 (zero-centred)
        offset = 1.0 if cfg.qk_norm == "rms" else 0.0
        weights["q_norm.weight"] = uniform(generator, (d,), 0.5) + offset
        weights["k_norm.weight"] = uniform(generator, (d,), 0.5) + offset
    return weights


def metadata_for(cfg):
    return {
        "d_model": str(cfg.d_model),
        "num_heads": str(cfg.num_heads),
        "num_kv_heads": str(cfg.num_kv_heads),
        "head_dim": str(cfg.head_dim),
        "batch": str(cfg.batch),
        "seq_len": str(cfg.seq_len),
        "causal": "true" if cfg.causal else "false",
        "gate": cfg.gate,
        "gate_layout": cfg.gate_layout,
        "bias": "true" if cfg.bias else "false",
        "gate_bias": "true" if cfg.gate_bias else "false",
        **({"sinks": "true"} if cfg.sinks else {}),
        **({"sliding_window": str(cfg.sliding_window)} if cfg.sliding_window else {}),
        **({"logit_softcap": repr(cfg.logit_softcap)} if cfg.logit_softcap else {}),
        **({"alibi": "true"} if cfg.alibi else {}),
        **({"qk_norm": cfg.qk_norm, "rms_norm_eps": "1e-06"} if cfg.qk_norm else {}),
        **({"rotary_dim": str(cfg.rotary_dim), "rope_style": cfg.rope_style,
            "rope_theta": repr(cfg.rope_theta)} if cfg.rotary_dim else {}),
        "generator": f"scripts/make_fixtures.py, torch {torch.__version__}",
    }


def config_from_metadata(name, meta):
    return FixtureConfig(
        name=name, seed=-1,
        d_model=int(meta["d_model"]), num_heads=int(meta["num_heads"]),
        num_kv_heads=int(meta["num_kv_heads"]), head_dim=int(meta["head_dim"]),
        batch=int(meta["batch"]), seq_len=int(meta["seq_len"]),
        causal=meta["causal"] == "true", gate=meta["gate"],
        gate_layout=meta["gate_layout"], bias=meta["bias"] == "true",
        gate_bias=meta["gate_bias"] == "true", sinks=meta.get("sinks") == "true",
        sliding_window=int(meta.get("sliding_window", "0")),
        logit_softcap=float(meta.get("logit_softcap", "0")), alibi=meta.get("alibi") == "true",
        qk_norm=meta.get("qk_norm", ""), rotary_dim=int(meta.get("rotary_dim", "0")),
        rope_style=meta.get("rope_style", "neox"), rope_theta=float(meta.get("rope_theta", "10000.0")))


# ---------------------------------------------------------------------------
# Reference forward pass (torch, float64)
# ---------------------------------------------------------------------------

def linear(x, tensors, prefix):
    y = torch.matmul(x, tensors[prefix + ".weight"].t())
    bias = tensors.get(prefix + ".bias")
    return y if bias is None else y + bias


def bloom_alibi_slopes(n):
    """BLOOM's build_alibi_tensor slopes: geometric for the closest power of two, then every
    other slope of twice as many heads."""
    closest = 2 ** math.floor(math.log2(n))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != n:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** p for p in range(1, 2 * min(closest, n - closest), 2)]
    return slopes


def causal_mask(n_q, n_k):
    """Boolean [n_q, n_k], True where query i may attend to key j (bottom-right aligned)."""
    rows = torch.arange(n_q).unsqueeze(1)
    cols = torch.arange(n_k).unsqueeze(0)
    return cols <= rows + (n_k - n_q)


def torch_forward(cfg, tensors32):
    """Return (output, gate_scores or None, first_key_attention), all float64."""
    t = {name: value.to(torch.float64) for name, value in tensors32.items()}
    x = t["input"]
    B, N = cfg.batch, cfg.seq_len
    H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    q_full = linear(x, t, "q_proj")
    if cfg.fused_gate:
        # HF Qwen3-Next: q_proj(x).view(B, N, H, 2d).chunk(2, dim=-1)
        q, gate_logits = q_full.view(B, N, H, 2 * d).chunk(2, dim=-1)
        gate_logits = gate_logits.reshape(B, N, H * d)
    else:
        q = q_full.view(B, N, H, d)
        gate_logits = linear(x, t, "gate_proj") if cfg.gate != "none" else None
    k = linear(x, t, "k_proj").view(B, N, Hkv, d)
    v = linear(x, t, "v_proj").view(B, N, Hkv, d)

    if cfg.qk_norm:  # HF Qwen3RMSNorm / Qwen3NextRMSNorm over head_dim
        def rms_norm(z, weight):
            z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS)
            return z * (weight if cfg.qk_norm == "rms" else 1.0 + weight)
        q = rms_norm(q, t["q_norm.weight"])
        k = rms_norm(k, t["k_norm.weight"])
    if cfg.rotary_dim:  # HF rotary embedding, positions 0..N-1
        r = cfg.rotary_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
        freqs = torch.outer(torch.arange(N, dtype=torch.float64), inv_freq)  # [N, r/2]
        if cfg.rope_style == "neox":
            emb = torch.cat((freqs, freqs), dim=-1)

            def rotate(z):
                return torch.cat((-z[..., r // 2:], z[..., :r // 2]), dim=-1)
        else:  # GPT-J rotate_every_two
            emb = freqs.repeat_interleave(2, dim=-1)

            def rotate(z):
                return torch.stack((-z[..., 1::2], z[..., ::2]), dim=-1).flatten(-2)
        cos, sin = emb.cos().view(1, N, 1, r), emb.sin().view(1, N, 1, r)

        def rope(z):
            rot, rest = z[..., :r], z[..., r:]
            return torch.cat((rot * cos + rotate(rot) * sin, rest), dim=-1)
        q, k = rope(q), rope(k)

    group = H // Hkv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)

    q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, H, N, d]
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    if cfg.logit_softcap:  # Gemma 2: before the mask
        scores = torch.tanh(scores / cfg.logit_softcap) * cfg.logit_softcap
    if cfg.alibi:  # BLOOM: + slope_h * key position (with the causal mask, as -slope_h * |i - j|)
        slopes = torch.tensor(bloom_alibi_slopes(H), dtype=torch.float64).view(1, H, 1, 1)
        scores = scores + slopes * torch.arange(N, dtype=torch.float64).view(1, 1, 1, N)
    if cfg.causal:
        allowed = causal_mask(N, N)
        if cfg.sliding_window:  # gpt-oss: key j hidden from query i when i - j >= window
            allowed = allowed & (torch.arange(N).unsqueeze(1) - torch.arange(N).unsqueeze(0) < cfg.sliding_window)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if cfg.sinks:  # gpt-oss: a sink column joins the softmax, then is dropped
        sink = t["sinks"].view(1, H, 1, 1).expand(B, H, N, 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)  # [B, H, N, N]
    attended = torch.matmul(probs, v).transpose(1, 2).reshape(B, N, H * d)

    gate_scores = None
    if gate_logits is not None:
        gate_scores = torch.sigmoid(gate_logits)
        if cfg.gate == "g1_headwise":
            gate = gate_scores.repeat_interleave(d, dim=-1)
        else:
            gate = gate_scores
        attended = attended * gate

    output = linear(attended, t, "o_proj")
    first_key = probs[..., 0].transpose(1, 2).contiguous()  # [B, N, H]
    return output, gate_scores, first_key


# ---------------------------------------------------------------------------
# Second, independent forward pass (NumPy einsum, explicit index arithmetic)
# ---------------------------------------------------------------------------

def numpy_forward(cfg, arrays32):
    a = {name: np.asarray(value, dtype=np.float64) for name, value in arrays32.items()}
    x = a["input"]
    B, N = cfg.batch, cfg.seq_len
    H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = H // Hkv

    def project(prefix, rows=None):
        w = a[prefix + ".weight"]
        b = a.get(prefix + ".bias")
        if rows is not None:
            w = w[rows]
            b = None if b is None else b[rows]
        y = np.einsum("bnc,oc->bno", x, w)
        return y if b is None else y + b

    if cfg.fused_gate:
        query_rows = [h * 2 * d + e for h in range(H) for e in range(d)]
        gate_rows = [h * 2 * d + d + e for h in range(H) for e in range(d)]
        q = project("q_proj", query_rows)
        gate_logits = project("q_proj", gate_rows)
    else:
        q = project("q_proj")
        gate_logits = project("gate_proj") if cfg.gate != "none" else None
    k = project("k_proj")
    v = project("v_proj")

    def heads(m, n_heads):
        return m.reshape(B, N, n_heads, d)

    if cfg.qk_norm:
        offset = 0.0 if cfg.qk_norm == "rms" else 1.0
        def norm(m, n_heads, weight):
            z = heads(m, n_heads)
            return (z / np.sqrt((z ** 2).mean(axis=-1, keepdims=True) + RMS_NORM_EPS) * (offset + weight)).reshape(m.shape)
        q = norm(q, H, a["q_norm.weight"])
        k = norm(k, Hkv, a["k_norm.weight"])
    if cfg.rotary_dim:  # each feature pair as a complex number times e^(i p theta_j)
        r = cfg.rotary_dim
        angle = np.arange(N)[:, None] * cfg.rope_theta ** (-2.0 * np.arange(r // 2) / r)  # [N, r/2]
        turn = np.exp(1j * angle)[None, :, None, :]
        if cfg.rope_style == "neox":
            first, second = np.arange(r // 2), np.arange(r // 2) + r // 2
        else:
            first, second = 2 * np.arange(r // 2), 2 * np.arange(r // 2) + 1
        def rope(m, n_heads):
            z = heads(m, n_heads).copy()
            c = (z[..., first] + 1j * z[..., second]) * turn
            z[..., first], z[..., second] = c.real, c.imag
            return z.reshape(m.shape)
        q = rope(q, H)
        k = rope(k, Hkv)

    # Split the KV head index of each query head explicitly: h = kv * group + g.
    q = q.reshape(B, N, Hkv, group, d)
    k = k.reshape(B, N, Hkv, d)
    v = v.reshape(B, N, Hkv, d)
    scores = np.einsum("bikgd,bjkd->bkgij", q, k) / np.sqrt(d)
    if cfg.logit_softcap:
        c = cfg.logit_softcap
        scores = c * np.tanh(scores / c)
    if cfg.alibi:  # the distance form: -m_h |i - j|, head h = kv * group + g
        # Press et al. §3 for n' = 2^floor(log2 H) heads, then odd powers of 2n' heads' base.
        n2 = 1 << (H.bit_length() - 1)
        slopes = np.array([2.0 ** (-8.0 * (h + 1) / n2) if h < n2 else 2.0 ** (-4.0 * (2 * (h - n2) + 1) / n2)
                           for h in range(H)])
        distance = np.abs(np.arange(N)[:, None] - np.arange(N)[None, :])
        scores = scores - slopes.reshape(1, Hkv, group, 1, 1) * distance
    if cfg.causal:
        w = cfg.sliding_window or N + 1
        allowed = np.array([[j <= i and i - w < j for j in range(N)] for i in range(N)])
        scores = np.where(allowed, scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    sink_term = 0.0
    if cfg.sinks:  # e^(s_h - m) in the denominator, no value
        sinks = a["sinks"].reshape(1, Hkv, group, 1, 1)
        m = np.maximum(m, sinks)
        sink_term = np.exp(sinks - m)
    weights = np.exp(scores - m)
    probs = weights / (weights.sum(axis=-1, keepdims=True) + sink_term)  # [B, Hkv, group, Nq, Nk]
    attended = np.einsum("bkgij,bjkd->bikgd", probs, v).reshape(B, N, H, d)

    gate_scores = None
    if gate_logits is not None:
        gate_scores = 1.0 / (1.0 + np.exp(-gate_logits))
        if cfg.gate == "g1_headwise":
            attended = attended * gate_scores[:, :, :, None]
        else:
            attended = attended * gate_scores.reshape(B, N, H, d)

    output = np.einsum("bnc,oc->bno", attended.reshape(B, N, H * d), a["o_proj.weight"])
    if "o_proj.bias" in a:
        output = output + a["o_proj.bias"]
    first_key = probs[..., 0].reshape(B, H, N).transpose(0, 2, 1)
    return output, gate_scores, first_key


# ---------------------------------------------------------------------------
# Build and check
# ---------------------------------------------------------------------------

def build_fixture(cfg):
    tensors32 = make_tensors(cfg)
    output, gate_scores, first_key = torch_forward(cfg, tensors32)
    arrays = {name: value.numpy().astype("<f4") for name, value in tensors32.items()}
    arrays["output"] = output.numpy().astype("<f8")
    if gate_scores is not None:
        arrays["gate_scores"] = gate_scores.numpy().astype("<f8")
    arrays["first_key_attention"] = first_key.numpy().astype("<f8")
    return arrays, metadata_for(cfg)


def max_abs_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def check_file(path, expected=None):
    """Re-read a fixture and recompute its outputs with the NumPy path."""
    metadata, arrays, _ = read_safetensors(path)
    cfg = config_from_metadata(path.stem, metadata)
    B, N, D, H = cfg.batch, cfg.seq_len, cfg.d_model, cfg.num_heads

    if expected is not None:
        expected_arrays, expected_metadata = expected
        assert metadata == expected_metadata, f"{path}: metadata mismatch"
        assert list(arrays) == list(expected_arrays), f"{path}: tensor names mismatch"
        for name, array in expected_arrays.items():
            assert arrays[name].dtype == array.dtype, f"{path}: {name} dtype mismatch"
            assert arrays[name].tobytes() == array.tobytes(), f"{path}: {name} bytes differ"

    assert arrays["output"].shape == (B, N, D)
    assert arrays["first_key_attention"].shape == (B, N, H)
    inputs = {name: value for name, value in arrays.items() if value.dtype == DTYPES["F32"]}
    output, gate_scores, first_key = numpy_forward(cfg, inputs)

    errors = {"output": max_abs_diff(output, arrays["output"]),
              "first_key_attention": max_abs_diff(first_key, arrays["first_key_attention"])}
    if gate_scores is not None:
        assert arrays["gate_scores"].shape == (B, N, cfg.gate_width)
        errors["gate_scores"] = max_abs_diff(gate_scores, arrays["gate_scores"])
    else:
        assert "gate_scores" not in arrays, f"{path}: ungated file has gate_scores"
    worst = max(errors.values())
    if worst > TOLERANCE:
        raise AssertionError(f"{path}: second path disagrees: {errors}")
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only verify the existing files in tests/data")
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR,
                        help="directory for the .safetensors files (default: tests/data)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # keep float64 reductions in a fixed order
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for cfg in FIXTURES:
        path = args.out_dir / f"{cfg.name}.safetensors"
        expected = None
        if args.check:
            metadata, _, _ = read_safetensors(path)
            stored = {k: v for k, v in metadata.items() if k != "generator"}
            wanted = {k: v for k, v in metadata_for(cfg).items() if k != "generator"}
            assert stored == wanted, f"{path}: metadata does not match the fixture table"
        else:
            expected = build_fixture(cfg)
            path.write_bytes(encode_safetensors(*expected))
        worst = check_file(path, expected)
        print(f"{path.name}: {path.stat().st_size} bytes, "
              f"max |torch - numpy| = {worst:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
