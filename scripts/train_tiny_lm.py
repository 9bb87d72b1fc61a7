#!/usr/bin/python3
"""Train three tiny byte-level language models on fortunes: ungated, gated and with sinks.

The models are identical except for how they let a head attend to nothing (and, to match the
gate's parameters, the ungated models' wider MLP): same architecture, same seed, same initial
values for every tensor they share, same batches in the same order.
"baseline" uses plain attention; "gated" is Qwen3-Next's full attention (a G1 elementwise
sigmoid gate fused into q_proj); "sinks" is the baseline with gpt-oss's learned attention sinks
(one logit per head in each softmax denominator, no value). They are small enough for a C++
implementation to reproduce them token for token from the exported weights.

Data: every fortune file in /usr/share/games/fortunes (Debian package fortunes) that has a
matching .dat index, sorted by file name, split into fortunes on lines that are exactly "%";
each fortune's trailing whitespace is stripped, empty ones and ones that are not valid UTF-8
are dropped, and each is followed by "\\n%\\n". The fortunes are shuffled with a fixed seed;
the last 5 % (by count) are held out (assets/tiny_lm/heldout.txt, the bytes as the model sees
them), the rest are the training text. Tokens are bytes: vocab 256, token = byte value.

Model (per sequence of N tokens at positions 0..N-1; nn.Linear layout W[out, in], no biases):
  * x = embed_tokens[token]; per layer (pre-norm):
      h = x + self_attn(input_layernorm(x)); x = h + mlp(post_attention_layernorm(h)),
      mlp(z) = down_proj(silu(gate_proj(z)) * up_proj(z));
    then logits = lm_head(norm(x)) (untied).
  * Every norm is Qwen3-Next's zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w).
  * self_attn follows transformers' Qwen3NextAttention (see make_qwen3_next_fixture.py):
    gated: q_proj has H*2*d rows, rows [h*2d, h*2d+d) query head h, the next d its gate logits;
    baseline: q_proj has H*d rows, all query. q_norm / k_norm over head_dim (never the gate, not
    the value); partial NeoX RoPE on the first r = int(d * partial_rotary_factor) dims,
    inv_freq = theta^(-arange(0, r, 2) / r), rotate_half pairs (j, j + r/2); GQA: query head h
    reads KV head h // (H / Hkv); scale 1/sqrt(head_dim); causal softmax;
    gated: o_proj(attention * sigmoid(gate)); baseline and sinks: o_proj(attention).
  * sinks: self_attn.sinks [H] (init 0, not decayed); head h's softmax over its scores
    s_1..s_n gets the extra logit sinks[h] in its denominator, as gpt-oss's eager attention
    (softmax over [scores | sink], sink column dropped): p_j = e^s_j / (e^sinks[h] + sum e^s_i).

Parameters are matched: the ungated models' SwiGLU MLP is wider by the gate's parameter count
(H * d * D per layer, 3 * D per unit: intermediate size 384 + 43 = 427 against 384).

Training: normal(0, 0.02) init for every matrix and the embedding, norm weights 0; the gated
model's query rows and first 384 MLP units are the baseline's, its gate rows come from a second
generator and the ungated models' extra 43 units from a third; the sinks model's sink logits
start at 0. AdamW, random 257-byte windows of the training text, float32,
one thread per model, the models trained at once in parallel processes.

Exported per model (assets/tiny_lm/{baseline,gated,sinks}/): config.json (Hugging Face key names),
model.safetensors (F32, HF names) and reference.safetensors, computed in float64 from exactly
the stored float32 weights:
  * prompt_tokens I64 [P]: the prompt's bytes, the same for every model: the first of PROMPTS
    whose 64 greedy choices are clear (top-2 margin >= 1e-3) and varied in every model;
  * generated_tokens I64 [64]: greedy (argmax) continuation of the prompt;
  * logits F64 [P + 63, 256]: one causal pass over prompt + generated_tokens[:-1];
    row t is the distribution of token t + 1;
  * min_top2_margin F64 [1]: smallest top-1 minus top-2 logit over the 64 greedy choices;
  * heldout_nll F64 [1]: mean negative log-likelihood in nats per byte over the first 8
    non-overlapping 256-byte windows of heldout.txt. Window w is bytes [256w, 256w + 256),
    run as its own sequence at positions 0..255; bytes 1..255 of each window are predicted
    from their prefixes, so heldout_tokens I64 [1] = 8 * 255 = 2040 predictions, averaged
    with equal weight. (The held-out loss in training_log.json uses the same convention over
    every full window of heldout.txt, in float32.)
training_log.json holds the steps, wall time and losses; README.md describes the lot.

After writing, every file is read back and the references are recomputed with a second,
NumPy-based path that decodes token by token with an explicit KV cache; it must agree with the
stored logits and heldout_nll to 1e-10 and produce the same greedy tokens.

Usage:
  scripts/train_tiny_lm.sh                                # same as the next line, deps checked
  /usr/bin/python3 scripts/train_tiny_lm.py               # train, export, check (45-100 min on 2 cores)
  /usr/bin/python3 scripts/train_tiny_lm.py --models sinks  # train one model, keep the others
  /usr/bin/python3 scripts/train_tiny_lm.py --quick       # 20 steps into a temporary directory
  /usr/bin/python3 scripts/train_tiny_lm.py --references-only  # redo references, logs, README
  /usr/bin/python3 scripts/train_tiny_lm.py --import-trained RUN  # the models examples/train_tiny_lm
      # trained into RUN/{baseline,gated,sinks}/: copied, then references, logs and README
  /usr/bin/python3 scripts/train_tiny_lm.py --check       # only check the existing files
  /usr/bin/python3 scripts/train_tiny_lm.py --trainer-fixture DIR [--small]
      # the C++ trainer's check (examples/train_tiny_lm): per model, the initial weights, the
      # windows of the first 20 steps, the optimiser's settings and learning rates, and the
      # losses of those steps in float64 and float32. --small: a reduced config (hidden 16,
      # 2 layers, windows of 33 bytes, batch 2), as committed in tests/data/train_tiny_lm.
"""

import argparse
import json
import math
import multiprocessing
import queue
import random
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from safetensors_io import encode_safetensors, read_safetensors

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = REPO_ROOT / "assets" / "tiny_lm"
FORTUNE_DIR = Path("/usr/share/games/fortunes")
MODELS = ("baseline", "gated", "sinks")

SPLIT_SEED = 5001   # shuffles the fortunes before the held-out split
INIT_SEED = 5002    # every tensor both models share
GATE_SEED = 5003    # the gated model's gate rows of q_proj
DATA_SEED = 5004    # training windows
WIDE_SEED = 5005    # the MLP units the ungated models get in place of the gate's parameters
HELDOUT_FRACTION = 0.05
SEPARATOR = b"\n%\n"

STEPS = 1500
QUICK_STEPS = 20
BATCH = 16
PEAK_LR = 3e-3
MIN_LR_RATIO = 0.1  # cosine decay ends at PEAK_LR * MIN_LR_RATIO
WARMUP_STEPS = 100
WEIGHT_DECAY = 0.1  # matrices and embedding only; norm weights are not decayed
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
INIT_STD = 0.02
LOG_EVERY = 50

REFERENCE_WINDOWS = 8
GENERATE = 64
SAMPLE = 200  # bytes of greedy continuation the demo prints
# The reference prompt is the first of these whose 64 greedy choices have a clear top-1 and
# are not one byte repeated (a tiny model easily falls into "      ...") in every model, and
# whose 200-byte greedy samples do not loop (no substring of MAX_REPEAT bytes or more occurs
# twice).
PROMPTS = [
    "Q: What is the meaning of life?\nA: ",
    "Q: How many programmers does it take to change a light bulb?\nA: ",
    "A computer is ",
    "Love is ",
    "The best way to ",
    "Q: Why did the chicken cross the road?\nA: ",
    "Never trust ",
    "Life is ",
]
MIN_MARGIN = 1e-3  # float32 rounding cannot flip a greedy choice with this top-1 - top-2 gap
MIN_DISTINCT = 8   # distinct bytes in each model's continuation
MAX_REPEAT = 32    # a greedy sample whose longest repeated substring is this long has looped
TOLERANCE = 1e-10
MAX_MODEL_BYTES = 4 * 1024 * 1024

BASE_CONFIG = {
    "architectures": ["GattnTinyLM"],
    "model_type": "gattn_tiny_lm",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "initializer_range": INIT_STD,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "attention_bias": False,
    "attn_output_gate": None,  # set per model
    "tie_word_embeddings": False,
    "layer_types": ["full_attention"] * 4,
    "torch_dtype": "float32",
}


def matched_intermediate_size():
    """The ungated models' MLP width: the gated model's, widened by the gate's parameters
    (H * head_dim * hidden_size per layer, 3 * hidden_size per SwiGLU unit), rounded."""
    c = BASE_CONFIG
    gate = c["num_attention_heads"] * c["head_dim"] * c["hidden_size"]
    return c["intermediate_size"] + round(gate / (3 * c["hidden_size"]))


def model_config(name):
    config = dict(BASE_CONFIG)
    config["attn_output_gate"] = name == "gated"
    if name != "gated":  # matched in parameters to the gated model
        config["intermediate_size"] = matched_intermediate_size()
    if name == "sinks":
        config["attention_sinks"] = True  # gattn's config key for gpt-oss-style sinks
    return config


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------

def fortune_files():
    """Fortune files with a .dat index, sorted by name (no .dat/.u8 files, no directories)."""
    return sorted(p for p in FORTUNE_DIR.iterdir()
                  if p.is_file() and p.suffix not in (".dat", ".u8")
                  and p.with_name(p.name + ".dat").is_file())


def load_fortunes():
    fortunes = []
    for path in fortune_files():
        current = []
        for line in path.read_bytes().split(b"\n") + [b"%"]:
            if line != b"%":
                current.append(line)
                continue
            fortune = b"\n".join(current).rstrip()
            current = []
            try:
                fortune.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if fortune:
                fortunes.append(fortune)
    return fortunes


def split_corpus():
    """(training bytes, held-out bytes, number of training fortunes, held-out fortunes)."""
    fortunes = load_fortunes()
    random.Random(SPLIT_SEED).shuffle(fortunes)
    n_heldout = int(round(len(fortunes) * HELDOUT_FRACTION))
    train, heldout = fortunes[:-n_heldout], fortunes[-n_heldout:]
    join = lambda fs: b"".join(f + SEPARATOR for f in fs)
    return join(train), join(heldout), len(train), len(heldout)


def windows(data, length):
    """Every full non-overlapping window of `length` bytes, as int64 [count, length]."""
    count = len(data) // length
    return torch.frombuffer(bytearray(data[:count * length]), dtype=torch.uint8) \
        .view(count, length).long()


# ---------------------------------------------------------------------------
# Model (torch; the same code trains in float32 and gives the float64 reference)
# ---------------------------------------------------------------------------

class Dims:
    def __init__(self, config):
        self.V = config["vocab_size"]
        self.D = config["hidden_size"]
        self.I = config["intermediate_size"]
        self.L = config["num_hidden_layers"]
        self.H = config["num_attention_heads"]
        self.Hkv = config["num_key_value_heads"]
        self.d = config["head_dim"]
        self.rotary_dim = int(self.d * config["partial_rotary_factor"])
        self.theta = float(config["rope_theta"])
        self.eps = float(config["rms_norm_eps"])
        self.context = config["max_position_embeddings"]
        self.gated = bool(config["attn_output_gate"])
        self.sinks = bool(config.get("attention_sinks", False))


def weight_shapes(dims):
    D, I, H, Hkv, d = dims.D, dims.I, dims.H, dims.Hkv, dims.d
    shapes = {"model.embed_tokens.weight": (dims.V, D)}
    for i in range(dims.L):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": ((2 if dims.gated else 1) * H * d, D),
            p + "self_attn.k_proj.weight": (Hkv * d, D),
            p + "self_attn.v_proj.weight": (Hkv * d, D),
            p + "self_attn.o_proj.weight": (D, H * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        })
        if dims.sinks:
            shapes[p + "self_attn.sinks"] = (H,)
        shapes.update({
            p + "post_attention_layernorm.weight": (D,),
            p + "mlp.gate_proj.weight": (I, D),
            p + "mlp.up_proj.weight": (I, D),
            p + "mlp.down_proj.weight": (D, I),
        })
    shapes["model.norm.weight"] = (D,)
    shapes["lm_head.weight"] = (dims.V, D)
    return shapes


def init_weights(dims):
    """Initial float32 weights. Shared tensors are drawn from INIT_SEED in a fixed order that
    does not depend on the gate or the sinks; the gate rows come from GATE_SEED, the ungated
    models' extra MLP units from WIDE_SEED, and the sink logits are 0, so the models start
    from the same values everywhere they overlap."""
    generator = torch.Generator().manual_seed(INIT_SEED)
    gate_generator = torch.Generator().manual_seed(GATE_SEED)
    wide_generator = torch.Generator().manual_seed(WIDE_SEED)
    H, d, D = dims.H, dims.d, dims.D
    I0 = BASE_CONFIG["intermediate_size"]
    weights = {}
    for name, shape in weight_shapes(dims).items():
        if len(shape) == 1:
            weights[name] = torch.zeros(shape)
        elif name.endswith("q_proj.weight"):
            query = torch.randn((H * d, D), generator=generator) * INIT_STD
            if dims.gated:
                gate = torch.randn((H * d, D), generator=gate_generator) * INIT_STD
                query = torch.cat((query.view(H, d, D), gate.view(H, d, D)), dim=1)
            weights[name] = query.reshape(shape).contiguous()
        elif ".mlp." in name:  # units [0, I0) shared, the rest the ungated models' own
            unit_axis = 1 if name.endswith("down_proj.weight") else 0
            shared = list(shape)
            shared[unit_axis] = I0
            extra = list(shape)
            extra[unit_axis] = shape[unit_axis] - I0
            weights[name] = torch.cat((torch.randn(shared, generator=generator) * INIT_STD,
                                       torch.randn(extra, generator=wide_generator) * INIT_STD),
                                      dim=unit_axis).contiguous()
        else:
            weights[name] = torch.randn(shape, generator=generator) * INIT_STD
    return weights


def rms_norm(x, weight, eps):
    """Qwen3NextRMSNorm: zero-centred weight, normalised over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(n, dims, dtype):
    """cos, sin [n, r] for positions 0..n-1, computed in float64."""
    r = dims.rotary_dim
    inv_freq = 1.0 / dims.theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    freqs = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x, cos, sin, r):
    """x [B, N, heads, d]; cos, sin [N, r]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


# Debian's torch sends float32 matmuls to the reference BLAS; its oneDNN convolutions are 5-15x
# faster on this model's shapes. In float32, matrix products therefore run as 1x1 convolutions;
# in float64 (the reference) they are plain matmuls.

def conv_mm_nt(a, b):
    """a [n, c] @ b [m, c].T -> [n, m] as one 1x1 convolution."""
    return F.conv2d(a[:, :, None, None], b[:, :, None, None]).view(a.shape[0], b.shape[0])


class BatchedMatmulNT(torch.autograd.Function):
    """a [G, n, c] @ b [G, m, c].T -> [G, n, m], forward and backward as 1x1 convolutions."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.stack([conv_mm_nt(x, y) for x, y in zip(a, b)])

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_t, a_t, b_t = (t.transpose(1, 2).contiguous() for t in (grad, a, b))
        grad_a = torch.stack([conv_mm_nt(g, y) for g, y in zip(grad, b_t)])    # grad @ b
        grad_b = torch.stack([conv_mm_nt(g, x) for g, x in zip(grad_t, a_t)])  # grad.T @ a
        return grad_a, grad_b


def linear(x, weight):
    """x @ weight.T."""
    if x.dtype != torch.float32:
        return F.linear(x, weight)
    y = F.conv2d(x.reshape(-1, x.shape[-1], 1, 1), weight[:, :, None, None])
    return y.view(*x.shape[:-1], weight.shape[0])


def matmul_nt(a, b):
    """a [..., n, c] @ b [..., m, c].T over matching leading dims."""
    if a.dtype != torch.float32:
        return torch.matmul(a, b.transpose(-1, -2))
    lead, n, m = a.shape[:-2], a.shape[-2], b.shape[-2]
    out = BatchedMatmulNT.apply(a.reshape(-1, n, a.shape[-1]).contiguous(),
                                b.reshape(-1, m, b.shape[-1]).contiguous())
    return out.view(*lead, n, m)


def attention(w, p, x, cos, sin, mask, dims):
    B, N, _ = x.shape
    H, Hkv, d = dims.H, dims.Hkv, dims.d
    q = linear(x, w[p + "q_proj.weight"])
    if dims.gated:
        q, gate = torch.chunk(q.view(B, N, H, 2 * d), 2, dim=-1)
        gate = gate.reshape(B, N, H * d)
    else:
        q = q.view(B, N, H, d)
    q = rms_norm(q, w[p + "q_norm.weight"], dims.eps)
    k = rms_norm(linear(x, w[p + "k_proj.weight"]).view(B, N, Hkv, d),
                 w[p + "k_norm.weight"], dims.eps)
    v = linear(x, w[p + "v_proj.weight"]).view(B, N, Hkv, d)
    q = apply_partial_rope(q, cos, sin, dims.rotary_dim)
    k = apply_partial_rope(k, cos, sin, dims.rotary_dim)

    group = H // Hkv
    q = q.transpose(1, 2)                                        # [B, H, N, d]
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = matmul_nt(q, k) * dims.d ** -0.5
    scores = scores.masked_fill(mask, float("-inf"))
    if dims.sinks:  # gpt-oss: a sink column joins the softmax, then is dropped
        sink = w[p + "sinks"].view(1, H, 1, 1).expand(B, H, N, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = matmul_nt(probs, v.transpose(-1, -2)).transpose(1, 2).reshape(B, N, H * d)
    if dims.gated:
        out = out * torch.sigmoid(gate)
    return linear(out, w[p + "o_proj.weight"])


def forward(w, tokens, dims):
    """tokens [B, N] int64 at positions 0..N-1 -> logits [B, N, V] in the weights' dtype."""
    N = tokens.shape[1]
    x = F.embedding(tokens, w["model.embed_tokens.weight"])
    cos, sin = rope_cos_sin(N, dims, x.dtype)
    mask = torch.ones(N, N, dtype=torch.bool).triu(1)  # True = key after the query
    for i in range(dims.L):
        p = f"model.layers.{i}."
        h = x + attention(w, p + "self_attn.", rms_norm(x, w[p + "input_layernorm.weight"], dims.eps),
                          cos, sin, mask, dims)
        z = rms_norm(h, w[p + "post_attention_layernorm.weight"], dims.eps)
        x = h + linear(F.silu(linear(z, w[p + "mlp.gate_proj.weight"])) *
                         linear(z, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
    return linear(rms_norm(x, w["model.norm.weight"], dims.eps), w["lm_head.weight"])


def mean_nll(w, data, dims, max_windows=None, batch=32):
    """Mean NLL (nats per byte) over non-overlapping context-sized windows of `data`, each its
    own sequence at positions 0.., predicting bytes 1.. of the window; and the prediction count."""
    seqs = windows(data, dims.context)[:max_windows]
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(seqs), batch):
            chunk = seqs[start:start + batch]
            logits = forward(w, chunk, dims)[:, :-1]
            nll = F.cross_entropy(logits.reshape(-1, dims.V), chunk[:, 1:].reshape(-1),
                                  reduction="none")
            total += float(nll.double().sum())
            count += nll.numel()
    return total / count, count


# ---------------------------------------------------------------------------
# Training (one process per model)
# ---------------------------------------------------------------------------

def learning_rate(step, steps):
    """Linear warmup over WARMUP_STEPS, then cosine decay to PEAK_LR * MIN_LR_RATIO; step is 1-based."""
    warmup = min(WARMUP_STEPS, max(1, steps // 10))
    if step <= warmup:
        return PEAK_LR * step / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(weights):
    """AdamW over the weights: decay on matrices and the embedding, none on norm weights and sinks."""
    groups = [{"params": [t for t in weights.values() if t.dim() > 1], "weight_decay": WEIGHT_DECAY},
              {"params": [t for t in weights.values() if t.dim() == 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


def draw_batch(data, span, generator):
    """BATCH random windows of `span` bytes of data (uint8) -> int64 [BATCH, span]."""
    offsets = torch.randint(0, len(data) - span + 1, (BATCH,), generator=generator)
    return data[offsets[:, None] + torch.arange(span)[None, :]].long()


def train_step(weights, optimizer, batch, lr, dims):
    """One optimiser step on a batch of windows [B, N + 1]; returns the mean loss before it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = forward(weights, batch[:, :-1], dims)
    loss = F.cross_entropy(logits.reshape(-1, dims.V), batch[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(weights.values()), GRAD_CLIP)
    optimizer.step()
    return float(loss)


def train_worker(name, steps, out_dir, results):
    torch.set_num_threads(1)  # both models get one core each, and the sums have a fixed order
    torch.manual_seed(0)
    dims = Dims(model_config(name))
    train_text, heldout_text, _, _ = split_corpus()
    data = torch.frombuffer(bytearray(train_text), dtype=torch.uint8)
    data_generator = torch.Generator().manual_seed(DATA_SEED)
    span = dims.context + 1

    weights = {n: t.requires_grad_() for n, t in init_weights(dims).items()}
    optimizer = make_optimizer(weights)

    start, cpu_start = time.monotonic(), time.process_time()
    losses, curve = [], []
    for step in range(1, steps + 1):
        batch = draw_batch(data, span, data_generator)
        losses.append(train_step(weights, optimizer, batch, learning_rate(step, steps), dims))
        if step % LOG_EVERY == 0 or step == steps:
            recent = float(np.mean(losses[-LOG_EVERY:]))
            curve.append({"step": step, "train_loss": round(recent, 4)})
            print(f"[{name:8s}] step {step:5d}/{steps}  loss {recent:.4f}  "
                  f"lr {learning_rate(step, steps):.2e}  {time.monotonic() - start:6.0f} s", flush=True)
    seconds, cpu_seconds = time.monotonic() - start, time.process_time() - cpu_start

    final = {n: t.detach() for n, t in weights.items()}
    heldout_loss, heldout_count = mean_nll(final, heldout_text, dims)
    print(f"[{name:8s}] held-out loss {heldout_loss:.4f} nats/byte over {heldout_count} bytes",
          flush=True)
    model_dir = out_dir / name
    model_dir.mkdir(parents=True, exist_ok=True)
    arrays = {n: t.numpy().astype("<f4") for n, t in final.items()}
    (model_dir / "model.safetensors").write_bytes(encode_safetensors(arrays, {"format": "pt"}))
    results.put((name, {
        "steps": steps,
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),
        "final_train_loss": round(float(np.mean(losses[-LOG_EVERY:])), 4),
        "heldout_loss": round(heldout_loss, 4),
        "heldout_predictions": heldout_count,
        "parameters": sum(t.numel() for t in final.values()),
        "loss_curve": curve,
    }))


def train_models(names, steps, out_dir):
    """Train the named models in parallel processes; return {name: summary}."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=train_worker, args=(name, steps, out_dir, results))
               for name in names]
    for worker in workers:
        worker.start()
    summaries = {}
    try:
        while len(summaries) < len(names):
            if not any(w.is_alive() for w in workers) and results.empty():
                break
            try:
                name, summary = results.get(timeout=5)
                summaries[name] = summary
            except queue.Empty:  # poll the workers again
                pass
    finally:
        for worker in workers:
            worker.join()
    failed = [n for n, w in zip(names, workers) if w.exitcode != 0]
    if failed or len(summaries) != len(names):
        raise RuntimeError(f"training failed for {failed or 'a model'}")
    return summaries


def import_trained(run_dir, out_dir):
    """Copy the models that examples/train_tiny_lm (gattn's C++ trainer) wrote into
    run_dir/{baseline,gated,sinks}/ into out_dir, checked against this script's shapes; return
    ({name: summary} from their training logs, {steps, batch, window, seed} they share)."""
    summaries, settings = {}, []
    for name in MODELS:
        src = run_dir / name
        log = json.loads((src / "training_log.json").read_text())
        records, steps = log["records"], log["steps"]
        if [r["step"] for r in records] != list(range(1, steps + 1)):
            raise SystemExit(f"{src}: {len(records)} of {steps} steps trained")
        settings.append({k: log[k] for k in ("steps", "batch", "window", "seed")})
        _, model, dtypes = read_safetensors(src / "model.safetensors")
        if {n: tuple(a.shape) for n, a in model.items()} != weight_shapes(Dims(model_config(name))) or \
                set(dtypes.values()) != {"F32"}:
            raise SystemExit(f"{src}/model.safetensors: not the {name} model's F32 tensors")
        losses = [r["loss"] for r in records]
        evals = [r for r in records if "heldout_loss" in r]
        if not evals or evals[-1]["step"] != steps:
            raise SystemExit(f"{src}: no held-out loss at step {steps} (--eval-every)")
        summaries[name] = {
            "steps": steps,
            "seconds": round(records[-1]["seconds"], 1),
            "step_seconds": round(sum(r["step_seconds"] for r in records), 1),
            "final_train_loss": round(float(np.mean(losses[-LOG_EVERY:])), 4),
            "heldout_loss": round(evals[-1]["heldout_loss"], 4),
            "heldout_predictions": evals[-1]["heldout_predictions"],
            "parameters": int(sum(a.size for a in model.values())),
            "loss_curve": [{"step": s, "train_loss": round(float(np.mean(losses[max(0, s - LOG_EVERY):s])), 4)}
                           for s in range(LOG_EVERY, steps + 1, LOG_EVERY)],
            "heldout_curve": [{"step": r["step"], "heldout_loss": round(r["heldout_loss"], 4)} for r in evals],
        }
    if any(x != settings[0] for x in settings):
        raise SystemExit(f"the models were trained with different settings: {settings}")
    for name in MODELS:  # only once all three passed: a refused import leaves out_dir as it was
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        (out_dir / name / "model.safetensors").write_bytes((run_dir / name / "model.safetensors").read_bytes())
    return summaries, settings[0]


# ---------------------------------------------------------------------------
# Fixture for the C++ trainer (examples/train_tiny_lm)
# ---------------------------------------------------------------------------

FIXTURE_STEPS = 20
# --small: the same code path at a size whose fixture is small enough to commit.
SMALL_CONFIG = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                "max_position_embeddings": 32, "layer_types": ["full_attention"] * 2}
SMALL_BATCH = 2


def write_fixture(out_dir, steps):
    """For each model: its config.json; initial.safetensors, the float32 weights training starts
    from; fixture.safetensors, the windows of the first FIXTURE_STEPS steps (I64 [steps, BATCH,
    context + 1], drawn as train_worker draws them) and the mean training loss of each of those
    steps from train_step in float64 and in float32 (F64 [steps]); training.json, the optimiser's
    hyperparameters and the learning rate of each step (a run of `steps` steps)."""
    torch.set_num_threads(1)
    train_text, _, _, _ = split_corpus()
    data = torch.frombuffer(bytearray(train_text), dtype=torch.uint8)
    for name in MODELS:
        torch.manual_seed(0)
        config = model_config(name)
        dims = Dims(config)
        span = dims.context + 1
        generator = torch.Generator().manual_seed(DATA_SEED)
        batches = torch.stack([draw_batch(data, span, generator) for _ in range(FIXTURE_STEPS)])
        initial = init_weights(dims)
        rates = [learning_rate(step, steps) for step in range(1, FIXTURE_STEPS + 1)]
        losses = {}
        for dtype in (torch.float64, torch.float32):
            weights = {n: t.to(dtype).clone().requires_grad_() for n, t in initial.items()}
            optimizer = make_optimizer(weights)
            losses[dtype] = [train_step(weights, optimizer, batches[i], rates[i], dims)
                             for i in range(FIXTURE_STEPS)]
        model_dir = out_dir / name
        model_dir.mkdir(parents=True, exist_ok=True)
        write_json(model_dir / "config.json", config)
        (model_dir / "initial.safetensors").write_bytes(encode_safetensors(
            {n: t.numpy().astype("<f4") for n, t in initial.items()}, {"format": "pt"}))
        (model_dir / "fixture.safetensors").write_bytes(encode_safetensors({
            "windows": batches.numpy().astype("<i8"),
            "losses_float64": np.array(losses[torch.float64], dtype="<f8"),
            "losses_float32": np.array(losses[torch.float32], dtype="<f8"),
        }, {"torch": torch.__version__}))
        write_json(model_dir / "training.json", {
            "steps": steps, "fixture_steps": FIXTURE_STEPS, "batch": BATCH, "window": span,
            "peak_lr": PEAK_LR, "min_lr_ratio": MIN_LR_RATIO,
            "warmup_steps": min(WARMUP_STEPS, max(1, steps // 10)),
            "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "adam_eps": 1e-8,
            "grad_clip": GRAD_CLIP, "data_seed": DATA_SEED, "learning_rates": rates})
        print(f"[{name:8s}] float64 losses {losses[torch.float64][0]:.6f} .. "
              f"{losses[torch.float64][-1]:.6f} into {model_dir}", flush=True)


# ---------------------------------------------------------------------------
# float64 reference (torch, full recompute)
# ---------------------------------------------------------------------------

def to_float32(arrays):
    return {n: torch.from_numpy(np.asarray(a, dtype=np.float32)) for n, a in arrays.items()}


def to_float64(arrays):
    return {n: torch.from_numpy(np.asarray(a, dtype=np.float64)) for n, a in arrays.items()}


def greedy(w, prompt, dims, count=GENERATE):
    """Greedy continuation of count tokens, recomputing the whole sequence at every step."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            logits = forward(w, torch.tensor([tokens]), dims)[0, -1]
            tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt):]


def longest_repeat(tokens):
    """Length of the longest substring that occurs at least twice (overlaps allowed)."""
    best, n = 0, len(tokens)
    for shift in range(1, n):  # compare the sequence with itself shifted
        run = 0
        for i in range(n - shift):
            run = run + 1 if tokens[i] == tokens[i + shift] else 0
            best = max(best, run)
    return best


def top2_margin(logits):
    """Smallest top-1 minus top-2 gap over the rows of logits [n, V] (numpy)."""
    top = np.sort(logits, axis=-1)[:, -2:]
    return float(np.min(top[:, 1] - top[:, 0]))


def reference(arrays, config, prompt_text, heldout_text):
    dims = Dims(config)
    w = to_float64(arrays)
    prompt = list(prompt_text.encode("utf-8"))
    generated = greedy(w, prompt, dims)
    sequence = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        logits = forward(w, sequence, dims)[0].numpy()
    chosen = logits[len(prompt) - 1:]
    if list(np.argmax(chosen, axis=-1)) != generated:
        raise AssertionError("the teacher-forced pass disagrees with greedy decoding")
    nll, count = mean_nll(w, heldout_text, dims, max_windows=REFERENCE_WINDOWS)
    return {
        "prompt_tokens": np.array(prompt, dtype="<i8"),
        "generated_tokens": np.array(generated, dtype="<i8"),
        "logits": logits.astype("<f8"),
        "min_top2_margin": np.array([top2_margin(chosen)], dtype="<f8"),
        "heldout_nll": np.array([nll], dtype="<f8"),
        "heldout_tokens": np.array([count], dtype="<i8"),
    }


def reference_metadata(name, prompt_text):
    return {"model": name, "prompt": prompt_text,
            "generator": f"scripts/train_tiny_lm.py, torch {torch.__version__}"}


def build_references(out_dir, heldout_text):
    """({name: reference arrays}, prompt, min top-2 margin, {name: 200-byte sample}) for the
    first prompt of PROMPTS whose greedy choices are clear and varied and whose samples do not
    loop in every model; failing that, for the prompt whose samples loop least (shortest
    longest repeat) among those whose choices are clear and varied, then the largest margin."""
    models = {name: read_safetensors(out_dir / name / "model.safetensors")[1] for name in MODELS}
    candidates = []
    for prompt in PROMPTS:
        refs = {name: reference(models[name], model_config(name), prompt, heldout_text)
                for name in MODELS}
        samples = {name: greedy(to_float32(models[name]), list(prompt.encode("utf-8")),
                                Dims(model_config(name)), SAMPLE)  # as the demo decodes
                   for name in MODELS}
        margin = min(float(r["min_top2_margin"][0]) for r in refs.values())
        distinct = min(len(set(r["generated_tokens"].tolist())) for r in refs.values())
        repeat = max(longest_repeat(t) for t in samples.values())
        print(f"prompt {prompt!r}: min top-2 margin {margin:.4g}, {distinct} distinct bytes, "
              f"longest repeat in the samples {repeat} bytes")
        if margin >= MIN_MARGIN and distinct >= MIN_DISTINCT and repeat < MAX_REPEAT:
            return refs, prompt, margin, samples
        clear = margin >= MIN_MARGIN and distinct >= MIN_DISTINCT
        candidates.append(((clear, -repeat, margin), prompt, refs, samples))
    rank, prompt, refs, samples = max(candidates, key=lambda c: c[0])
    return refs, prompt, rank[2], samples


# ---------------------------------------------------------------------------
# Second, independent forward pass (NumPy, token by token with a KV cache)
# ---------------------------------------------------------------------------

class NumpyDecoder:
    def __init__(self, arrays, config):
        self.dims = dims = Dims(config)
        self.w = {n: np.asarray(a, dtype=np.float64) for n, a in arrays.items()}
        H, d = dims.H, dims.d
        # Row indices of the query and the gate inside q_proj.
        stride = 2 * d if dims.gated else d
        self.q_rows = [h * stride + e for h in range(H) for e in range(d)]
        self.g_rows = [h * stride + d + e for h in range(H) for e in range(d)] if dims.gated else []
        self.reset()

    def reset(self):
        L = self.dims.L
        self.keys = [[] for _ in range(L)]
        self.values = [[] for _ in range(L)]
        self.position = 0

    def norm(self, x, weight):
        return x / math.sqrt(float(np.dot(x, x)) / x.shape[-1] + self.dims.eps) * (1.0 + weight)

    def rope(self, heads):
        """heads [n, d] at self.position: rotate pairs (j, j + r/2) of the first r dims."""
        r = self.dims.rotary_dim
        out = heads.copy()
        for j in range(r // 2):
            angle = self.position * self.dims.theta ** (-2.0 * j / r)
            c, s = math.cos(angle), math.sin(angle)
            x0, x1 = heads[:, j], heads[:, j + r // 2]
            out[:, j] = x0 * c - x1 * s
            out[:, j + r // 2] = x1 * c + x0 * s
        return out

    def step(self, token):
        """Logits [V] of the next token after appending `token`."""
        dims, w = self.dims, self.w
        H, Hkv, d = dims.H, dims.Hkv, dims.d
        x = w["model.embed_tokens.weight"][token].copy()
        for i in range(dims.L):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            z = self.norm(x, w[p + "input_layernorm.weight"])
            wq = w[a + "q_proj.weight"]
            q = (wq[self.q_rows] @ z).reshape(H, d)
            q = self.rope(np.stack([self.norm(q[h], w[a + "q_norm.weight"]) for h in range(H)]))
            k = (w[a + "k_proj.weight"] @ z).reshape(Hkv, d)
            k = self.rope(np.stack([self.norm(k[h], w[a + "k_norm.weight"]) for h in range(Hkv)]))
            self.keys[i].append(k)
            self.values[i].append((w[a + "v_proj.weight"] @ z).reshape(Hkv, d))
            keys, values = np.stack(self.keys[i]), np.stack(self.values[i])  # [t+1, Hkv, d]
            out = np.empty((H, d))
            for h in range(H):
                kv = h // (H // Hkv)
                s = keys[:, kv] @ q[h] / math.sqrt(d)
                sink = w[a + "sinks"][h] if dims.sinks else -math.inf
                top = max(s.max(), sink)
                e = np.exp(s - top)
                out[h] = (e / (e.sum() + math.exp(sink - top))) @ values[:, kv]
            out = out.reshape(H * d)
            if dims.gated:
                out = out / (1.0 + np.exp(-(wq[self.g_rows] @ z)))
            h_res = x + w[a + "o_proj.weight"] @ out
            z = self.norm(h_res, w[p + "post_attention_layernorm.weight"])
            g = w[p + "mlp.gate_proj.weight"] @ z
            x = h_res + w[p + "mlp.down_proj.weight"] @ (g / (1.0 + np.exp(-g)) *
                                                          (w[p + "mlp.up_proj.weight"] @ z))
        self.position += 1
        return w["lm_head.weight"] @ self.norm(x, w["model.norm.weight"])


def numpy_reference(arrays, config, prompt, heldout_text):
    """(logits [P + 63, V], greedy tokens, heldout NLL, prediction count) via NumpyDecoder."""
    dec = NumpyDecoder(arrays, config)
    rows = [dec.step(t) for t in prompt]
    generated = []
    for _ in range(GENERATE):
        generated.append(int(np.argmax(rows[-1])))
        if len(generated) < GENERATE:
            rows.append(dec.step(generated[-1]))
    total, count = 0.0, 0
    n = dec.dims.context
    for wi in range(REFERENCE_WINDOWS):
        window = heldout_text[wi * n:(wi + 1) * n]
        dec.reset()
        for t in range(n - 1):
            logits = dec.step(window[t])
            top = logits.max()
            total += top + math.log(float(np.sum(np.exp(logits - top)))) - logits[window[t + 1]]
            count += 1
    return np.stack(rows), generated, total / count, count


# ---------------------------------------------------------------------------
# Files and checks
# ---------------------------------------------------------------------------

def write_json(path, value):
    path.write_text(json.dumps(value, indent=2) + "\n")


def check(out_dir, log=None, refs=None):
    """Read every file back and verify it; refs (when just built) must match byte for byte."""
    train_text, heldout_text, n_train, n_heldout = split_corpus()
    assert (out_dir / "heldout.txt").read_bytes() == heldout_text, "heldout.txt differs"
    stored_log = json.loads((out_dir / "training_log.json").read_text())
    if log is not None:
        assert stored_log == log, "training_log.json differs"
    prompts = set()
    for name in MODELS:
        model_dir = out_dir / name
        config = json.loads((model_dir / "config.json").read_text())
        assert config == model_config(name), f"{name}/config.json differs from this script"
        dims = Dims(config)
        size = (model_dir / "model.safetensors").stat().st_size
        assert size <= MAX_MODEL_BYTES, f"{name}/model.safetensors is {size} bytes"
        _, model, dtypes = read_safetensors(model_dir / "model.safetensors")
        assert {n: tuple(a.shape) for n, a in model.items()} == weight_shapes(dims), \
            f"{name}: tensor names or shapes"
        assert set(dtypes.values()) == {"F32"}, f"{name}: model dtypes {set(dtypes.values())}"
        meta, ref, ref_dtypes = read_safetensors(model_dir / "reference.safetensors")
        prompts.add(meta["prompt"])
        prompt = list(meta["prompt"].encode("utf-8"))
        if refs is not None:
            assert meta == reference_metadata(name, meta["prompt"]), f"{name}: metadata"
            assert list(ref) == list(refs[name]), f"{name}: reference names"
            for n, a in refs[name].items():
                assert ref[n].dtype == a.dtype and ref[n].tobytes() == a.tobytes(), \
                    f"{name}: reference {n} bytes differ"
        P = len(prompt)
        assert list(ref["prompt_tokens"]) == prompt
        assert ref["generated_tokens"].shape == (GENERATE,)
        assert ref["logits"].shape == (P + GENERATE - 1, dims.V)
        assert ref_dtypes["logits"] == "F64" and ref_dtypes["generated_tokens"] == "I64"
        assert int(ref["heldout_tokens"][0]) == REFERENCE_WINDOWS * (dims.context - 1)

        logits, generated, nll, count = numpy_reference(model, config, prompt, heldout_text)
        assert generated == list(ref["generated_tokens"]), f"{name}: greedy tokens differ"
        assert count == int(ref["heldout_tokens"][0])
        diff_logits = float(np.max(np.abs(logits - ref["logits"])))
        diff_nll = abs(nll - float(ref["heldout_nll"][0]))
        margin = top2_margin(ref["logits"][P - 1:])
        assert margin == float(ref["min_top2_margin"][0]), f"{name}: min_top2_margin"
        if diff_logits > TOLERANCE or diff_nll > TOLERANCE:
            raise AssertionError(f"{name}: NumPy KV-cache path disagrees with the stored "
                                 f"reference: logits {diff_logits:.3e}, heldout_nll {diff_nll:.3e}")
        print(f"{name}: max |torch - numpy| logits {diff_logits:.3e}, heldout_nll {diff_nll:.3e}; "
              f"min top-2 margin {margin:.4g}; heldout_nll {float(ref['heldout_nll'][0]):.4f}")
        print(f"{name}: {meta['prompt']!r} -> "
              f"{bytes(ref['generated_tokens'].tolist()).decode('utf-8', 'replace')!r}")
    assert len(prompts) == 1, "the models' prompts differ"
    assert stored_log["data"]["train_fortunes"] == n_train
    assert stored_log["data"]["heldout_fortunes"] == n_heldout
    assert stored_log["data"]["train_bytes"] == len(train_text)


def check_shared_init():
    """Every tensor the models share starts equal; the gated query rows and MLP units are the
    baseline's, the sink logits start at 0, and the models match in parameters."""
    base = init_weights(Dims(model_config("baseline")))
    gated = init_weights(Dims(model_config("gated")))
    sinks = init_weights(Dims(model_config("sinks")))
    dims = Dims(model_config("gated"))
    H, d, D = dims.H, dims.d, dims.D
    assert base.keys() == gated.keys()
    assert set(sinks) - set(base) == {f"model.layers.{i}.self_attn.sinks" for i in range(dims.L)}
    for name, tensor in base.items():
        other = gated[name]
        assert torch.equal(tensor, sinks[name]), f"initial {name} differs between the models"
        if name.endswith("q_proj.weight"):
            other = other.view(H, 2 * d, D)[:, :d].reshape(H * d, D)
        elif name.endswith("down_proj.weight"):
            tensor = tensor[:, :other.shape[1]]
        elif ".mlp." in name:
            tensor = tensor[:other.shape[0]]
        assert torch.equal(tensor, other), f"initial {name} differs between the models"
    assert all(not torch.any(sinks[n]) for n in sinks if n.endswith("sinks"))
    counts = [sum(t.numel() for t in w.values()) for w in (base, gated)]
    assert abs(counts[0] - counts[1]) <= 3 * D * dims.L, f"parameters {counts} not matched"


def readme(log, prompt, refs):
    c = BASE_CONFIG
    t = log["training"]
    d = log["data"]
    rotary = int(c["head_dim"] * c["partial_rotary_factor"])
    rows = "\n".join(
        f"| {name} | {log[name]['steps']} | {log[name]['seconds']:.0f} s | "
        f"{log[name]['step_seconds' if 'trainer' in t else 'cpu_seconds']:.0f} s | "
        f"{log[name]['final_train_loss']:.4f} | {log[name]['heldout_loss']:.4f} | "
        f"{float(refs[name]['heldout_nll'][0]):.4f} | {float(refs[name]['min_top2_margin'][0]):.3f} |"
        for name in MODELS)
    samples = "\n".join(
        f"    {name + ':':9s} {bytes(refs[name]['generated_tokens'].tolist()).decode('utf-8', 'replace')!r}"
        for name in MODELS)
    as_here = ", as here" if max(log[m]["sample_longest_repeat"] for m in MODELS) >= MAX_REPEAT else ""
    long_samples = "\n\n".join(
        f"{name} (longest repeat {log[name]['sample_longest_repeat']} bytes):\n\n    " +
        log[name]["sample_text"].replace("\n", "\n    ")
        for name in MODELS)
    schedule = (f"{t['steps']} steps of AdamW (betas {BETAS[0]}, {BETAS[1]}; weight decay {WEIGHT_DECAY} on "
                f"matrices and the embedding, none on norm weights), batches of {t['batch']} random windows "
                f"of {t['window']} bytes of the training text")
    lr = (f"learning rate {PEAK_LR:g} after {t['warmup_steps']} linear warmup steps, cosine decay to "
          f"{PEAK_LR * MIN_LR_RATIO:g}, gradient norm clipped to {GRAD_CLIP:g}")
    init = (f"Init: normal(0, {INIT_STD}) for the embedding and every matrix, norm weights and sink "
            f"logits 0; the gated model's query rows and first {c['intermediate_size']} MLP units are "
            "the baseline's, its gate rows come from a second generator and the ungated models' other "
            "MLP units from a third.")
    if "trainer" in t:
        training = f"""## Training

Trained by gattn: `examples/train_tiny_lm` (C++; attention forward and backward through
gattn, the rest written with Eigen; see its README), float32, one thread per model:

    /usr/bin/python3 scripts/train_tiny_lm.py --trainer-fixture build/fixture   # initial weights
    build/examples/examples/train_tiny_lm --config build/fixture/gated/config.json \\
        --weights build/fixture/gated/initial.safetensors --out run/gated --steps {t['steps']} --eval-every 250
    /usr/bin/python3 scripts/train_tiny_lm.py --import-trained run   # run/{{baseline,gated,sinks}}

""" + textwrap.fill(
            f"{init} {schedule}, drawn by `std::mt19937_64` from seed {t['seed']} (the same windows for "
            f"the three models), {lr}. `training_log.json` has the training loss every {LOG_EVERY} steps "
            f"(mean of the last {LOG_EVERY}) and the held-out loss at every evaluation. "
            "`scripts/train_tiny_lm.sh` trains the same three models in PyTorch instead (1500 steps by "
            "default, 45 to 100 minutes on 2 cores).", 95)
        time_column = "time in steps"
        time_note = "so does the time in steps, which\nleaves out the held-out evaluations."
    else:
        training = f"""## Training

    scripts/train_tiny_lm.sh    # checks the Debian packages, then runs
                                # /usr/bin/python3 scripts/train_tiny_lm.py

""" + textwrap.fill(
            f"torch {t['torch']}, float32, one CPU thread per model, the models trained at once (or one "
            f"at a time with `--models`: the weights do not depend on it). {init} {schedule}, {lr}. A "
            "rerun with the same torch on the same kind of CPU gives the same weights. "
            f"`training_log.json` has the loss every {LOG_EVERY} steps.", 95)
        time_column = "CPU time"
        time_note = "the CPU time is the training loop's."
    return f"""# Tiny byte-level language models: plain attention, the output gate, learned sinks

Three small decoder-only language models trained on the same text, identical except for how a
head may attend to nothing (and the ungated models' MLP, widened to the gated model's parameter
count), so that the paper's gate can be compared with gpt-oss's sinks like
for like, and a C++ implementation checked against PyTorch token for token:

- `baseline/`: plain attention (`"attn_output_gate": false`);
- `gated/`: Qwen3-Next full attention, an elementwise sigmoid gate on the attention output
  (G1) fused into `q_proj` (`"attn_output_gate": true`);
- `sinks/`: the baseline with learned attention sinks as in gpt-oss, one logit per head
  (`self_attn.sinks` [H], `"attention_sinks": true`) in each softmax denominator, without a value.

All start from the same seed, with the same initial value for every tensor they share, and
see the same batches in the same order. Each directory holds `config.json` (Hugging Face key
names), `model.safetensors` (float32 weights under Hugging Face names, nn.Linear layout
`W[out, in]`) and `reference.safetensors` (float64 outputs, below).

## Data

The English text of the Debian package `fortunes`: the data files of BSD `fortune`
(fortune-mod 1.99.1), Copyright (c) 1991 The Regents of the University of California and the
contributors named there, BSD licence; see `/usr/share/doc/fortunes/copyright`.

Every file in `/usr/share/games/fortunes` with a `.dat` index, in name order, is split into
fortunes on lines that are exactly `%`. Each fortune's trailing whitespace is stripped, empty
fortunes and any that are not UTF-8 are dropped, and each fortune is followed by `\\n%\\n`.
The fortunes are shuffled with a fixed seed and the last 5 % are held out:

| split | fortunes | bytes |
|---|---|---|
| training | {d['train_fortunes']} | {d['train_bytes']} |
| held out (`heldout.txt`, the bytes as the model sees them) | {d['heldout_fortunes']} | {d['heldout_bytes']} |

Tokens are bytes: vocabulary 256, token = byte value.

## Architecture

| | |
|---|---|
| hidden size | {c['hidden_size']} |
| layers | {c['num_hidden_layers']}, all full attention |
| attention heads / KV heads / head_dim | {c['num_attention_heads']} / {c['num_key_value_heads']} / {c['head_dim']} |
| MLP | SwiGLU, intermediate size {c['intermediate_size']} (gated), {matched_intermediate_size()} (baseline, sinks: widened by the gate's parameters) |
| context | {c['max_position_embeddings']} |
| RoPE | NeoX, theta {c['rope_theta']:g}, first {rotary} of {c['head_dim']} dims (partial_rotary_factor {c['partial_rotary_factor']}) |
| norms | zero-centred RMSNorm, eps {c['rms_norm_eps']:g} |
| biases | none; `lm_head` not tied to the embedding |
| parameters | baseline {log['baseline']['parameters']}, gated {log['gated']['parameters']}, sinks {log['sinks']['parameters']} |

Per sequence, tokens at positions 0, 1, 2, …:

    x = embed_tokens[token]
    per layer:  h = x + self_attn(input_layernorm(x))
                x = h + down_proj(silu(gate_proj(z)) * up_proj(z)),  z = post_attention_layernorm(h)
    logits = lm_head(norm(x))
    RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * (1 + w)

`self_attn` is transformers' Qwen3NextAttention (see `scripts/make_qwen3_next_fixture.py`).
gated: `q_proj` has H·2·d rows; rows [h·2d, h·2d + d) are query head h and the next d rows its
gate logits. baseline: `q_proj` has H·d rows, all query. Then per-head `q_norm` / `k_norm`
over head_dim (not the gate, not the value), RoPE after the norms, GQA (query head h reads KV
head h // 2), scale 1/sqrt(head_dim), causal softmax, and `o_proj(attention * sigmoid(gate))`
with the gate taken from the raw `q_proj` output (gated) or `o_proj(attention)` (baseline,
sinks). sinks: head h's weights are e^s_j / (e^sinks[h] + Σ_i e^s_i) over its visible scores s
(gpt-oss's eager attention: softmax over the scores and a sink column, the column dropped).

{training}

| model | steps | wall time | {time_column} | train loss | held-out loss | heldout_nll | min top-2 margin |
|---|---|---|---|---|---|---|---|
{rows}

The wall time depends on what else the machine runs; {time_note}
Losses are in nats per byte. Train loss: mean training-batch loss over the last {LOG_EVERY}
steps. Held-out loss: every full 256-byte window of `heldout.txt`, in float32, with the
convention of `heldout_nll` below (which covers only the first 8 windows, in float64).

## Reference outputs (`reference.safetensors`)

Computed in float64 from exactly the stored float32 weights, and checked by the script against
a second, NumPy implementation that decodes token by token with a KV cache (agreement to
1e-10).

- `prompt_tokens` I64 [P]: the bytes of the prompt {prompt!r}, the same for every model.
- `generated_tokens` I64 [64]: the greedy (argmax) continuation.
- `logits` F64 [P + 63, 256]: one causal pass over prompt + `generated_tokens[:-1]`; row t
  scores token t + 1, so rows P - 1 … P + 62 give the 64 greedy choices.
- `min_top2_margin` F64 [1]: the smallest top-1 minus top-2 logit gap over those 64 choices,
  far above float32 rounding, so a float32 implementation generates the same tokens.
- `heldout_nll` F64 [1] and `heldout_tokens` I64 [1]: the mean negative log-likelihood, in
  nats per byte, over the first 8 non-overlapping 256-byte windows of `heldout.txt`. Window w
  is bytes [256·w, 256·w + 256), run as its own sequence at positions 0 … 255; bytes 1 … 255
  of each window are predicted from their prefixes, so there are 8 · 255 = 2040 predictions,
  equally weighted.

Greedy continuations of the prompt:

{samples}

## Greedy samples of 200 bytes

What `scripts/demo.sh` prints (computed here in float32, which the demo reproduces), with the
length of the longest substring that occurs twice in each (a model that loops repeats most of
the sample). The prompt is the first of the script's list whose samples all stay under
{MAX_REPEAT} bytes and whose 64 reference choices are clear; when none does{as_here}, the one
whose samples loop least among those with clear choices.

{long_samples}
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps (default {STEPS}; {QUICK_STEPS} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run into a temporary directory, to check the script")
    parser.add_argument("--check", action="store_true",
                        help="only verify the existing files in the output directory")
    parser.add_argument("--references-only", action="store_true",
                        help="train nothing: recompute the references, logs and README from the "
                             "weights in the output directory")
    parser.add_argument("--import-trained", type=Path, default=None, metavar="RUN_DIR",
                        help="train nothing: take the models examples/train_tiny_lm wrote into "
                             "RUN_DIR/{baseline,gated,sinks}/ (with their training logs), then "
                             "compute the references, logs and README as after training")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                        help="models to train (default: all); the others must already be in the "
                             "output directory, trained with the same steps, and are kept")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="output directory (default assets/tiny_lm; a temporary one with --quick)")
    parser.add_argument("--trainer-fixture", type=Path, default=None, metavar="DIR",
                        help=f"write the C++ trainer's check (the first {FIXTURE_STEPS} steps' "
                             "initial weights, windows, hyperparameters and float64/float32 "
                             "losses of each model) into DIR, and nothing else")
    parser.add_argument("--small", action="store_true",
                        help="with --trainer-fixture: a reduced config (hidden 16, 2 layers, "
                             f"context {SMALL_CONFIG['max_position_embeddings']}, batch {SMALL_BATCH})")
    args = parser.parse_args()
    if args.trainer_fixture:
        global BATCH
        if args.small:
            BASE_CONFIG.update(SMALL_CONFIG)
            BATCH = SMALL_BATCH
        write_fixture(args.trainer_fixture, args.steps or STEPS)
        return 0
    if args.references_only or args.import_trained:
        args.models = []
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    trainer = None
    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="tiny_lm_")) if args.quick else OUT_DIR)
    if args.import_trained:
        steps = json.loads((args.import_trained / MODELS[0] / "training_log.json").read_text())["steps"]
    elif args.references_only and not args.steps:
        steps = json.loads((out_dir / "training_log.json").read_text())["training"]["steps"]
    torch.set_num_threads(1)  # keep float64 reductions in a fixed order

    if not args.check:
        check_shared_init()
        train_text, heldout_text, n_train, n_heldout = split_corpus()
        print(f"{n_train} training fortunes ({len(train_text)} bytes), {n_heldout} held out "
              f"({len(heldout_text)} bytes); {steps} steps into {out_dir}", flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "heldout.txt").write_bytes(heldout_text)
        summaries = {}
        if args.import_trained:
            summaries, trainer = import_trained(args.import_trained, out_dir)
        elif set(args.models) != set(MODELS):  # keep the other models' weights and training logs
            previous = json.loads((out_dir / "training_log.json").read_text())
            if previous["training"]["steps"] != steps:
                raise SystemExit(f"the kept models were trained for {previous['training']['steps']} "
                                 f"steps, not {steps}")
            summaries = {name: previous[name] for name in MODELS if name not in args.models}
            if "trainer" in previous["training"]:  # kept models from the C++ trainer
                if args.models:
                    raise SystemExit("the kept models were trained by examples/train_tiny_lm: train "
                                     "all three here, or import all three (--import-trained)")
                trainer = {k: previous["training"][k] for k in ("steps", "batch", "window", "seed")}
            for summary in summaries.values():  # recomputed below
                for key in ("heldout_nll_8_windows_float64", "min_top2_margin", "generated_text",
                            "sample_text", "sample_longest_repeat"):
                    summary.pop(key, None)
        summaries.update(train_models(args.models, steps, out_dir))

        refs, prompt, margin, samples = build_references(out_dir, heldout_text)
        if margin < MIN_MARGIN:
            message = f"no prompt gives a top-2 margin of {MIN_MARGIN} in every model"
            if not args.quick:
                raise AssertionError(message)
            print(f"warning: {message} (best {margin:.3g})")
        for name in MODELS:
            write_json(out_dir / name / "config.json", model_config(name))
            (out_dir / name / "reference.safetensors").write_bytes(
                encode_safetensors(refs[name], reference_metadata(name, prompt)))
        log = {
            "data": {"train_fortunes": n_train, "train_bytes": len(train_text),
                     "heldout_fortunes": n_heldout, "heldout_bytes": len(heldout_text)},
            "training": {"steps": steps, "batch": BATCH, "window": BASE_CONFIG["max_position_embeddings"] + 1,
                         "peak_lr": PEAK_LR, "warmup_steps": min(WARMUP_STEPS, max(1, steps // 10)),
                         "torch": torch.__version__},
            "prompt": prompt,
        }
        if trainer:  # trained by examples/train_tiny_lm; torch only computed the references
            log["training"].update(trainer, trainer="examples/train_tiny_lm")
            del log["training"]["torch"]
        for name in MODELS:
            log[name] = summaries[name]
            log[name]["heldout_nll_8_windows_float64"] = round(float(refs[name]["heldout_nll"][0]), 6)
            log[name]["min_top2_margin"] = round(float(refs[name]["min_top2_margin"][0]), 6)
            log[name]["generated_text"] = bytes(refs[name]["generated_tokens"].tolist()).decode(
                "utf-8", "replace")
            log[name]["sample_text"] = bytes(samples[name]).decode("utf-8", "replace")
            log[name]["sample_longest_repeat"] = longest_repeat(samples[name])
        write_json(out_dir / "training_log.json", log)
        (out_dir / "README.md").write_text(readme(log, prompt, refs))
        check(out_dir, log, refs)
    else:
        check(out_dir)
    for path in sorted(out_dir.rglob("*")):
        if path.is_file():
            print(f"{path.relative_to(out_dir)}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
