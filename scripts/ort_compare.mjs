// SPDX-License-Identifier: Apache-2.0
// gattn's float SDPA against ONNX Runtime's attention contrib ops (npm's onnxruntime-node), one
// thread, one process per contender per round, rounds interleaved; prints medians and per-round
// ratios as Markdown tables. scripts/ort_compare.sh installs onnxruntime-node, builds gattn's
// benchmark and runs this; docs/benchmarks.md ("gattn beside ONNX Runtime") explains the figures.
//
//   node scripts/ort_compare.mjs --bench build/avx2/bench/bench_sdpa --ort build/ort [--rounds 5]
//   node scripts/ort_compare.mjs --ort build/ort --worker decode:32768:8   (one ONNX Runtime case)
//   node scripts/ort_compare.mjs ... --mlas avx2   (ONNX Runtime on MLAS's AVX2 kernels; below)
//
// Cases (8 query heads, head_dim d = 128, float32, batch 1):
//   prefill, N = 2048, non-causal: ONNX Runtime's MultiHeadAttention (com.microsoft) against
//     gattn's BM_GattnSdpa/Nq:2048/Nk:2048/d:128/causal:0/threads:1; FLOPs 4·N²·d·H = 17.18 G.
//   prefill, N = 2048, causal: GroupQueryAttention (always causal; 8 KV heads, no past) against
//     BM_GattnSdpa/.../causal:1; FLOPs counted as the unmasked half, 2·N²·d·H = 8.59 G.
//   decode, one query token over N_k = 8192 or 32768 keys (N_k − 1 cached, one new), 2 or 8 KV
//     heads: GroupQueryAttention with a past KV cache against BM_DecodeVsEigen/Nk:N_k/kv_heads:…,
//     which times gattn over token-major keys and values ([N_k, H_kv·d], gattn's cache layout),
//     attention written with Eigen, and gattn over head-major ones ([H_kv·N_k, d], HeadMajorRows:
//     ONNX Runtime's cache layout) in turn in one process. FLOPs 4·N_k·d·H
//     (8.4 M at 8k keys); the times are what matters there (the cache is read from memory).
// ONNX Runtime's time is its profiler's kernel time of the attention node (the `_kernel_time`
// event), median over the timed runs of one process. For decoding, the past cache and the
// present output share one buffer (preallocated output bound to the input's memory), as
// onnxruntime-genai runs GroupQueryAttention, so that the kernel does not copy the cache; the
// run with a separate present output (the kernel copies the whole cache first) is printed beside
// it (`copy`). gattn's times are Google Benchmark's wall-clock medians within its process.
//
// `--mlas avx2`: MLAS, ONNX Runtime's kernel library, picks its kernels from CPUID when the
// library loads, and nothing in ONNX Runtime limits it to AVX2. So that an AVX2 build of gattn
// meets ONNX Runtime's AVX2 kernels on a CPU with AVX-512, this option runs ONNX Runtime from a
// copy of the package (<ort>-mlas-avx2) in whose libonnxruntime.so one conditional jump of
// MLAS's platform setup, the test of CPUID's AVX512F bit, is made unconditional: the setup then
// keeps the kernels it chose for AVX2 and FMA, as on a CPU without AVX-512F. The jump's bytes
// are those of onnxruntime-node 1.31.1 (x64); the copy is refused unless they occur exactly once.

import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const kHeads = 8;
const kDim = 128;

// ---------------------------------------------------------------------------------------------
// A minimal protobuf writer for the few ONNX messages the models need (onnx.proto field numbers).

function varint(value) {
  let v = BigInt(value);
  const out = [];
  while (v >= 0x80n) {
    out.push(Number(v & 0x7fn) | 0x80);
    v >>= 7n;
  }
  out.push(Number(v));
  return out;
}

class Msg {
  constructor() { this.bytes = []; }
  tag(field, wire) { this.bytes.push(...varint((field << 3) | wire)); return this; }
  int(field, value) { this.tag(field, 0); this.bytes.push(...varint(value)); return this; }
  raw(field, data) {
    this.tag(field, 2);
    this.bytes.push(...varint(data.length));
    for (const b of data) this.bytes.push(b);
    return this;
  }
  str(field, s) { return this.raw(field, Buffer.from(s, 'utf8')); }
  msg(field, m) { return this.raw(field, m.bytes); }
  float(field, x) {
    const b = Buffer.alloc(4);
    b.writeFloatLE(x);
    this.tag(field, 5);
    this.bytes.push(...b);
    return this;
  }
}

const FLOAT = 1;
const INT32 = 6;

function attrInt(name, v) { return new Msg().str(1, name).int(20, 2).int(3, v); }        // type INT
function attrFloat(name, v) { return new Msg().str(1, name).int(20, 1).float(2, v); }    // type FLOAT

function valueInfo(name, elemType, dims) {
  const shape = new Msg();
  // Dimension: dim_value (a number) or dim_param (a name)
  for (const d of dims) shape.msg(1, typeof d === 'string' ? new Msg().str(2, d) : new Msg().int(1, d));
  const tensorType = new Msg().int(1, elemType).msg(2, shape);
  return new Msg().str(1, name).msg(2, new Msg().msg(1, tensorType));
}

// One com.microsoft node with the given inputs ('' for an omitted optional one) and outputs.
function model(opType, inputs, outputs, attrs, inputInfos, outputInfos) {
  const node = new Msg();
  for (const i of inputs) node.str(1, i);
  for (const o of outputs) node.str(2, o);
  node.str(3, 'attention').str(4, opType);
  for (const a of attrs) node.msg(5, a);
  node.str(7, 'com.microsoft');
  const graph = new Msg().msg(1, node).str(2, 'attention');
  for (const v of inputInfos) graph.msg(11, v);
  for (const v of outputInfos) graph.msg(12, v);
  return Uint8Array.from(new Msg()
    .int(1, 8)                                                       // ir_version
    .str(2, 'gattn ort_compare')
    .msg(7, graph)
    .msg(8, new Msg().str(1, '').int(2, 17))                         // opset_import
    .msg(8, new Msg().str(1, 'com.microsoft').int(2, 1)).bytes);
}

// ---------------------------------------------------------------------------------------------
// Cases.

function parseCase(name) {
  const [kind, a, b] = name.split(':');
  if (kind === 'prefill') return { kind, n: Number(a), causal: b === 'causal' };
  if (kind === 'decode' || kind === 'decodecopy') return { kind, nk: Number(a), kv: Number(b) };
  throw new Error(`ort_compare: unknown case ${name}`);
}

function flops(c) {
  if (c.kind === 'prefill') return (c.causal ? 2 : 4) * c.n * c.n * kDim * kHeads;
  return 4 * c.nk * kDim * kHeads;
}

function random(n) {
  const a = new Float32Array(n);
  for (let i = 0; i < n; ++i) a[i] = Math.random() * 2 - 1;
  return a;
}

// The model, feeds and preallocated fetches of one case.
function build(ort, c) {
  const hd = kHeads * kDim, scale = 1 / Math.sqrt(kDim);
  const T = (data, dims) => new ort.Tensor(data instanceof Int32Array ? 'int32' : 'float32', data, dims);
  if (c.kind === 'prefill' && !c.causal) {
    const dims = [1, c.n, hd];
    const bytes = model('MultiHeadAttention', ['query', 'key', 'value'], ['output'],
      [attrInt('num_heads', kHeads), attrFloat('scale', scale)],
      ['query', 'key', 'value'].map((n) => valueInfo(n, FLOAT, dims)), [valueInfo('output', FLOAT, dims)]);
    return { bytes, op: 'MultiHeadAttention',
      feeds: { query: T(random(c.n * hd), dims), key: T(random(c.n * hd), dims), value: T(random(c.n * hd), dims) } };
  }
  const gqa = (kv, qLen, pastLen, presentLen) => {
    const qdims = [1, qLen, hd], kdims = [1, qLen, kv * kDim];
    const inputs = ['query', 'key', 'value', pastLen > 0 ? 'past_key' : '', pastLen > 0 ? 'past_value' : '',
      'seqlens_k', 'total_sequence_length'];
    const infos = [valueInfo('query', FLOAT, qdims), valueInfo('key', FLOAT, kdims), valueInfo('value', FLOAT, kdims)];
    if (pastLen > 0) {
      infos.push(valueInfo('past_key', FLOAT, [1, kv, pastLen, kDim]));
      infos.push(valueInfo('past_value', FLOAT, [1, kv, pastLen, kDim]));
    }
    infos.push(valueInfo('seqlens_k', INT32, [1]), valueInfo('total_sequence_length', INT32, []));
    const pdims = [1, kv, presentLen ?? 'total', kDim];
    return model('GroupQueryAttention', inputs, ['output', 'present_key', 'present_value'],
      [attrInt('num_heads', kHeads), attrInt('kv_num_heads', kv), attrFloat('scale', scale)], infos,
      [valueInfo('output', FLOAT, qdims), valueInfo('present_key', FLOAT, pdims), valueInfo('present_value', FLOAT, pdims)]);
  };
  if (c.kind === 'prefill') {
    const bytes = gqa(kHeads, c.n, 0, c.n);
    const dims = [1, c.n, hd];
    return { bytes, op: 'GroupQueryAttention', feeds: {
      query: T(random(c.n * hd), dims), key: T(random(c.n * hd), dims), value: T(random(c.n * hd), dims),
      seqlens_k: T(Int32Array.of(c.n - 1), [1]), total_sequence_length: T(Int32Array.of(c.n), []) } };
  }
  // Decoding: N_k − 1 cached tokens and one new; seqlens_k = N_k − 1 (total length − 1).
  const share = c.kind === 'decode';
  const kvd = c.kv * kDim, past = share ? c.nk : c.nk - 1;
  const bytes = gqa(c.kv, 1, past, share ? c.nk : undefined);
  const pk = T(random(past * kvd), [1, c.kv, past, kDim]), pv = T(random(past * kvd), [1, c.kv, past, kDim]);
  const feeds = { query: T(random(hd), [1, 1, hd]), key: T(random(kvd), [1, 1, kvd]), value: T(random(kvd), [1, 1, kvd]),
    past_key: pk, past_value: pv, seqlens_k: T(Int32Array.of(c.nk - 1), [1]),
    total_sequence_length: T(Int32Array.of(c.nk), []) };
  const fetches = share ? { output: T(new Float32Array(hd), [1, 1, hd]), present_key: pk, present_value: pv } : undefined;
  return { bytes, op: 'GroupQueryAttention', feeds, fetches };
}

// ---------------------------------------------------------------------------------------------
// ONNX Runtime on MLAS's AVX2 kernels (see the top of this file).

// test r10d, 0x10000 (CPUID.7.EBX bit 16, AVX512F); je +0x0e (past the AVX-512 kernels);
// mov rax, r8; not rax; test al, 0xe0 (XCR0's opmask and ZMM state); je.
const kAvx512fTest = Buffer.from('41f7c20000010074 0e4c89c048f7d0a8e00f84'.replace(/ /g, ''), 'hex');
const kJeOffset = 7;  // the first je: 0x74, made 0xeb (jmp)

function mlasAvx2Copy(ortPrefix) {
  const copy = `${ortPrefix.replace(/\/+$/, '')}-mlas-avx2`;
  const lib = 'node_modules/onnxruntime-node/bin/napi-v6/linux/x64/libonnxruntime.so.1';
  const marker = path.join(copy, 'mlas-avx2.json');
  const source = fs.statSync(path.join(ortPrefix, lib));
  const stamp = JSON.stringify({ size: source.size, mtime: source.mtimeMs });
  if (fs.existsSync(marker) && fs.readFileSync(marker, 'utf8') === stamp) return copy;
  fs.rmSync(copy, { recursive: true, force: true });
  fs.cpSync(ortPrefix, copy, { recursive: true });
  const so = fs.readFileSync(path.join(copy, lib));
  const at = so.indexOf(kAvx512fTest);
  if (at < 0 || so.indexOf(kAvx512fTest, at + 1) >= 0) {
    fs.rmSync(copy, { recursive: true, force: true });
    throw new Error(`ort_compare: MLAS's AVX512F test was not found exactly once in ${path.join(ortPrefix, lib)}; ` +
      '--mlas avx2 knows onnxruntime-node 1.31.1 (x64) only');
  }
  so[at + kJeOffset] = 0xeb;
  fs.writeFileSync(path.join(copy, lib), so);
  fs.writeFileSync(marker, stamp);
  return copy;
}

// One ONNX Runtime case in this process: prints {"case", "kernel_us", "run_us", "runs"} as JSON.
async function worker(ortPrefix, name) {
  const require = createRequire(path.resolve(ortPrefix, 'node_modules') + '/');
  const ort = require('onnxruntime-node');
  const c = parseCase(name);
  const { bytes, op, feeds, fetches } = build(ort, c);
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'gattn-ort-'));
  const session = await ort.InferenceSession.create(bytes, {
    intraOpNumThreads: 1, interOpNumThreads: 1, executionMode: 'sequential', graphOptimizationLevel: 'all',
    logSeverityLevel: 3,  // errors only: the shape inference of present_key warns in the copying decode case
    enableProfiling: true, profileFilePrefix: path.join(dir, 'profile'),
  });
  const warmup = 2, minRuns = 5, minSeconds = 2;
  const runs = [];
  let total = 0;
  for (let i = 0; i < warmup || runs.length < minRuns || total < minSeconds; ++i) {
    const t0 = process.hrtime.bigint();
    await (fetches ? session.run(feeds, fetches) : session.run(feeds));
    const t = Number(process.hrtime.bigint() - t0) / 1e3;
    if (i >= warmup) { runs.push(t); total += t / 1e6; }
  }
  session.endProfiling();
  const file = fs.readdirSync(dir).find((f) => f.startsWith('profile'));
  const events = JSON.parse(fs.readFileSync(path.join(dir, file), 'utf8'));
  const kernel = events.filter((e) => e.cat === 'Node' && e.name.endsWith('_kernel_time') && e.args?.op_name === op)
    .map((e) => e.dur).slice(warmup);
  fs.rmSync(dir, { recursive: true, force: true });
  if (kernel.length !== runs.length) throw new Error(`ort_compare: ${kernel.length} kernel events for ${runs.length} runs`);
  await session.release();
  console.log(JSON.stringify({ case: name, kernel_us: median(kernel), run_us: median(runs), runs: runs.length,
    version: ort.env.versions?.node ?? ort.env.versions?.common ?? '' }));
}

// ---------------------------------------------------------------------------------------------
// Rounds.

function median(xs) {
  const s = [...xs].sort((a, b) => a - b), m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

const ortCases = ['prefill:2048:full', 'prefill:2048:causal', 'decode:8192:2', 'decode:8192:8', 'decode:32768:2',
  'decode:32768:8', 'decodecopy:8192:2', 'decodecopy:8192:8', 'decodecopy:32768:2', 'decodecopy:32768:8'];
const gattnFilter = '^BM_GattnSdpa/Nq:2048/Nk:2048/d:128/causal:[01]/threads:1/|' +
  '^BM_DecodeVsEigen/Nk:(8192|32768)/kv_heads:[28]/threads:1/';

function runGattn(bench) {
  const r = spawnSync(bench, [`--benchmark_filter=${gattnFilter}`, '--benchmark_format=json'], {
    env: { ...process.env, OMP_NUM_THREADS: '1' }, encoding: 'utf8', maxBuffer: 1 << 26 });
  if (r.status !== 0) throw new Error(`ort_compare: ${bench} failed: ${r.stderr}`);
  const json = JSON.parse(r.stdout), out = {};
  for (const b of json.benchmarks) {
    let m = b.name.match(/^BM_GattnSdpa\/Nq:2048\/Nk:2048\/d:128\/causal:([01])/);
    if (m) { out[`prefill:2048:${m[1] === '1' ? 'causal' : 'full'}`] = { us: b.real_time * unitUs(b.time_unit) }; continue; }
    m = b.name.match(/^BM_DecodeVsEigen\/Nk:(\d+)\/kv_heads:(\d+)/);
    if (m) out[`decode:${m[1]}:${m[2]}`] = { us: b.gattn_us, eigen_us: b.eigen_us, head_major_us: b.head_major_us };
  }
  return { cases: out, context: json.context };
}

function unitUs(unit) { return { ns: 1e-3, us: 1, ms: 1e3, s: 1e6 }[unit]; }

function runOrt(ortPrefix, name) {
  const r = spawnSync(process.execPath, [new URL(import.meta.url).pathname, '--ort', ortPrefix, '--worker', name], {
    encoding: 'utf8', maxBuffer: 1 << 20 });
  if (r.status !== 0) throw new Error(`ort_compare: ONNX Runtime case ${name} failed: ${r.stderr}`);
  return JSON.parse(r.stdout.trim().split('\n').pop());
}

function fmt(x, digits = 2) { return x.toFixed(digits); }

function report(rounds, context, ortVersion) {
  const lines = [];
  lines.push(`gattn ${context.gattn_version}, ${context.gattn_isa}; ONNX Runtime ${ortVersion}; ` +
    `${rounds.length} rounds, medians; host ${context.host_name}, ${context.num_cpus} CPUs.`);
  lines.push('');
  lines.push('| prefill, N = 2048 | gattn GFLOP/s | ONNX Runtime GFLOP/s | gattn / ONNX Runtime (per round) | median |');
  lines.push('|---|---|---|---|---|');
  for (const [key, label] of [['prefill:2048:full', 'non-causal (MultiHeadAttention)'],
    ['prefill:2048:causal', 'causal (GroupQueryAttention)']]) {
    const c = parseCase(key);
    const g = rounds.map((r) => r.gattn[key].us), o = rounds.map((r) => r.ort[key].kernel_us);
    const ratios = rounds.map((r) => r.ort[key].kernel_us / r.gattn[key].us);
    lines.push(`| ${label} | ${fmt(flops(c) / median(g) / 1e3, 1)} | ${fmt(flops(c) / median(o) / 1e3, 1)} | ` +
      `${ratios.map((x) => fmt(x)).join(' ')} | **${fmt(median(ratios))}** |`);
  }
  lines.push('');
  lines.push('| decode, N_k, KV heads | gattn ms | Eigen ms | ONNX Runtime ms | ONNX Runtime ms, copy | ' +
    'ONNX Runtime / gattn (per round) | median | Eigen / gattn median | gattn head-major ms | ' +
    'ONNX Runtime / gattn head-major (per round) | median |');
  lines.push('|---|---|---|---|---|---|---|---|---|---|---|');
  for (const nk of [8192, 32768]) {
    for (const kv of [2, 8]) {
      const key = `decode:${nk}:${kv}`, copy = `decodecopy:${nk}:${kv}`;
      const g = rounds.map((r) => r.gattn[key].us), e = rounds.map((r) => r.gattn[key].eigen_us);
      const o = rounds.map((r) => r.ort[key].kernel_us), oc = rounds.map((r) => r.ort[copy].kernel_us);
      const ratios = rounds.map((r) => r.ort[key].kernel_us / r.gattn[key].us);
      const eratios = rounds.map((r) => r.gattn[key].eigen_us / r.gattn[key].us);
      const h = rounds.map((r) => r.gattn[key].head_major_us);
      const hratios = rounds.map((r) => r.ort[key].kernel_us / r.gattn[key].head_major_us);
      lines.push(`| ${nk / 1024}k, ${kv} | ${fmt(median(g) / 1e3)} | ${fmt(median(e) / 1e3)} | ${fmt(median(o) / 1e3)} | ` +
        `${fmt(median(oc) / 1e3)} | ${ratios.map((x) => fmt(x)).join(' ')} | **${fmt(median(ratios))}** | ` +
        `${fmt(median(eratios))} | ${fmt(median(h) / 1e3)} | ${hratios.map((x) => fmt(x)).join(' ')} | ` +
        `**${fmt(median(hratios))}** |`);
    }
  }
  return lines.join('\n');
}

async function main() {
  const args = process.argv.slice(2);
  const opt = (name, dflt) => {
    const i = args.indexOf(name);
    return i >= 0 ? args[i + 1] : dflt;
  };
  const mlas = opt('--mlas', 'native');
  if (mlas !== 'native' && mlas !== 'avx2') throw new Error(`ort_compare: --mlas must be native or avx2, got '${mlas}'`);
  const ortPrefix = mlas === 'avx2' ? mlasAvx2Copy(opt('--ort', 'build/ort')) : opt('--ort', 'build/ort');
  if (opt('--worker')) return worker(ortPrefix, opt('--worker'));
  const bench = opt('--bench', 'build/avx2/bench/bench_sdpa');
  const nRounds = Number(opt('--rounds', '5'));
  const rounds = [];
  let context = {}, ortVersion = '';
  for (let i = 0; i < nRounds; ++i) {
    // Alternate which contender goes first, so that neither always runs on a warmer machine.
    const round = { gattn: null, ort: {} };
    const doGattn = () => { const g = runGattn(bench); round.gattn = g.cases; context = g.context; };
    const doOrt = () => {
      for (const name of ortCases) {
        round.ort[name] = runOrt(ortPrefix, name);
        ortVersion = round.ort[name].version;
      }
    };
    if (i % 2 === 0) { doGattn(); doOrt(); } else { doOrt(); doGattn(); }
    rounds.push(round);
    process.stderr.write(`round ${i + 1}/${nRounds} done\n`);
  }
  console.log(report(rounds, context,
    `${ortVersion} (onnxruntime-node${mlas === 'avx2' ? ', MLAS on its AVX2 kernels' : ''})`));
}

main().catch((e) => { console.error(e.message ?? e); process.exit(1); });
