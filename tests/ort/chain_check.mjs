#!/usr/bin/env node
// Independent check of pipeshard pipeline-stage files with onnxruntime-node.
//
//   node tests/ort/chain_check.mjs --model FULL.onnx --plan DIR/plan.json
//        [--batch 3] [--seed 1] [--rtol 1e-5] [--atol 1e-6] [--dim NAME=N]...
//        [--check-only]
//
// Full check: feed deterministic pseudo-random inputs to the full model, then
// run the stage files one after another (each fed exactly the inputs its plan
// entry declares, from a name->tensor dictionary that starts with the model
// inputs and collects every stage's outputs), and compare each full-model
// output with the same-named chained value: pass iff |a-b| <= atol + rtol*|b|
// everywhere (a = chained, b = full model).
//
// --check-only: only create an InferenceSession per stage file (and check its
// input/output names against the plan).
//
// Prints one JSON line on stdout. Exit status: 0 ok, 1 check failed (mismatch,
// rejected stage file, inconsistent plan), 2 usage or file errors.

import { existsSync, readFileSync } from 'node:fs';
import path from 'node:path';
import process from 'node:process';

class UsageError extends Error {}
class CheckError extends Error {}

const USAGE =
  'usage: node tests/ort/chain_check.mjs --model FULL.onnx --plan DIR/plan.json ' +
  '[--batch 3] [--seed 1] [--rtol 1e-5] [--atol 1e-6] [--dim NAME=N]... [--check-only]';

function parseArgs(argv) {
  const opt = { batch: 3, seed: 1, rtol: 1e-5, atol: 1e-6, checkOnly: false, dims: {}, model: null, plan: null };
  const num = (flag, v, { integer = false, min = -Infinity } = {}) => {
    if (v === undefined) throw new UsageError(`${flag} needs a value`);
    const n = Number(v);
    if (v.trim() === '' || !Number.isFinite(n) || (integer && !Number.isInteger(n)) || n < min) {
      throw new UsageError(`bad value for ${flag}: '${v}'`);
    }
    return n;
  };
  for (let i = 0; i < argv.length; i++) {
    let a = argv[i];
    let v;
    const eq = a.indexOf('=');
    if (a.startsWith('--') && eq > 0) {
      v = a.slice(eq + 1);
      a = a.slice(0, eq);
    }
    const take = () => {
      const val = v !== undefined ? v : argv[++i];
      if (val === undefined) throw new UsageError(`${a} needs a value`);
      return val;
    };
    switch (a) {
      case '--model': opt.model = take(); break;
      case '--plan': opt.plan = take(); break;
      case '--batch': opt.batch = num(a, take(), { integer: true, min: 1 }); break;
      case '--seed': opt.seed = num(a, take(), { integer: true, min: 0 }); break;
      case '--rtol': opt.rtol = num(a, take(), { min: 0 }); break;
      case '--atol': opt.atol = num(a, take(), { min: 0 }); break;
      case '--check-only':
        if (v !== undefined) throw new UsageError('--check-only takes no value');
        opt.checkOnly = true;
        break;
      case '--dim': {
        const d = take();
        const m = d === undefined ? null : /^([^=]+)=([0-9]+)$/.exec(d);
        if (!m || Number(m[2]) < 1) throw new UsageError(`bad --dim '${d}' (want NAME=N, N >= 1)`);
        opt.dims[m[1]] = Number(m[2]);
        break;
      }
      case '-h':
      case '--help':
        process.stdout.write(USAGE + '\n');
        process.exit(0);
        break;
      default:
        throw new UsageError(`unknown argument '${argv[i]}' (${USAGE})`);
    }
  }
  if (!opt.plan) throw new UsageError(`--plan is required (${USAGE})`);
  if (!opt.model && !opt.checkOnly) throw new UsageError(`--model is required (${USAGE})`);
  return opt;
}

function readJson(file) {
  let text;
  try {
    text = readFileSync(file, 'utf8');
  } catch (e) {
    throw new UsageError(`cannot read ${file}: ${e.code || e.message}`);
  }
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new UsageError(`${file} is not valid JSON: ${e.message}`);
  }
}

function validatePlan(plan, planPath) {
  const bad = (msg) => { throw new UsageError(`${planPath}: ${msg}`); };
  if (typeof plan !== 'object' || plan === null || Array.isArray(plan)) bad('top level must be an object');
  const tp = plan.tensor_parallel ?? 1;
  if (!Number.isInteger(tp) || tp < 1) bad(`bad tensor_parallel ${JSON.stringify(plan.tensor_parallel)}`);
  if (tp > 1) {
    bad(`tensor_parallel=${tp}: sharded stage files (with pipeshard collectives) cannot be chained by ` +
        'onnxruntime; check them with pipeshard\'s own simulator instead');
  }
  if (!Array.isArray(plan.stages) || plan.stages.length === 0) bad('"stages" must be a non-empty array');
  const ioList = (s, key) => {
    if (!Array.isArray(s[key])) bad(`stage ${s.stage}: "${key}" must be an array`);
    for (const t of s[key]) {
      if (typeof t !== 'object' || t === null || typeof t.name !== 'string' || t.name === '') {
        bad(`stage ${s.stage}: every "${key}" entry needs a "name"`);
      }
      if (t.shape !== undefined && !Array.isArray(t.shape)) bad(`stage ${s.stage}: ${t.name}: "shape" must be an array`);
    }
  };
  plan.stages.forEach((s, idx) => {
    if (typeof s !== 'object' || s === null) bad(`stages[${idx}] must be an object`);
    if (s.stage !== undefined && s.stage !== idx) bad(`stages[${idx}] has "stage": ${s.stage} (stages must be in order)`);
    ioList(s, 'inputs');
    ioList(s, 'outputs');
    if (!Array.isArray(s.files) || s.files.length !== 1 || typeof s.files[0] !== 'string') {
      bad(`stage ${idx}: "files" must list exactly one file when tensor_parallel is 1`);
    }
  });
}

// Deterministic PRNG (mulberry32), one stream per (seed, input index).
function mulberry32(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function resolveShape(name, shape, opt, fallback) {
  return shape.map((d, k) => {
    if (typeof d === 'number' && Number.isInteger(d) && d >= 0) return d;
    if (typeof d === 'string' && d in opt.dims) return opt.dims[d];
    if (d === 'batch') return opt.batch;
    const fb = fallback?.[k];
    if (typeof fb === 'number' && Number.isInteger(fb) && fb >= 0) return fb;
    throw new UsageError(`input '${name}': cannot size dimension ${k} (${JSON.stringify(d)}); ` +
                         'pass --dim NAME=N');
  });
}

function makeInput(ort, name, dtype, dims, seed, index) {
  const n = dims.reduce((a, d) => a * d, 1);
  const rnd = mulberry32((seed * 0x9e3779b1 + index * 0x85ebca77 + 1) >>> 0);
  if (dtype === 'float32') {
    const data = new Float32Array(n);
    for (let i = 0; i < n; i++) data[i] = rnd() * 2 - 1; // uniform [-1, 1)
    return new ort.Tensor('float32', data, dims);
  }
  if (dtype === 'int64') {
    const data = new BigInt64Array(n);
    for (let i = 0; i < n; i++) data[i] = BigInt(Math.floor(rnd() * 2)); // {0, 1}: safe as index/mask
    return new ort.Tensor('int64', data, dims);
  }
  throw new UsageError(`input '${name}': dtype ${dtype} is not supported (float32, int64 only)`);
}

function compareTensors(name, a, b, rtol, atol) {
  // a = chained, b = full model
  if (a.type !== b.type) return { ok: false, why: `'${name}': dtype ${a.type} (stages) vs ${b.type} (full)`, maxAbs: Infinity };
  if (a.dims.length !== b.dims.length || a.dims.some((d, k) => d !== b.dims[k])) {
    return { ok: false, why: `'${name}': shape [${a.dims}] (stages) vs [${b.dims}] (full)`, maxAbs: Infinity };
  }
  let maxAbs = 0;
  let bad = -1;
  const da = a.data;
  const db = b.data;
  for (let i = 0; i < da.length; i++) {
    const x = Number(da[i]);
    const y = Number(db[i]);
    if (Number.isNaN(x) || Number.isNaN(y)) {
      if (Number.isNaN(x) && Number.isNaN(y)) continue;
      maxAbs = Infinity;
      if (bad < 0) bad = i;
      continue;
    }
    if (x === y) continue; // also covers equal infinities
    const diff = Math.abs(x - y);
    if (!(diff <= maxAbs)) maxAbs = diff;
    if (!(diff <= atol + rtol * Math.abs(y)) && bad < 0) bad = i;
  }
  if (bad >= 0) {
    return { ok: false, maxAbs, why: `'${name}': element ${bad} differs: stages ${da[bad]} vs full ${db[bad]}` };
  }
  return { ok: true, maxAbs };
}

function checkDeclared(stageIdx, kind, declared, actual) {
  const want = new Set(declared.map((t) => t.name));
  const have = new Set(actual);
  const missing = [...want].filter((n) => !have.has(n));
  const extra = [...have].filter((n) => !want.has(n));
  if (missing.length || extra.length) {
    const parts = [];
    if (missing.length) parts.push(`declared in plan but not in file: ${missing.join(', ')}`);
    if (extra.length) parts.push(`in file but not declared in plan: ${extra.join(', ')}`);
    throw new CheckError(`stage ${stageIdx} ${kind}: ${parts.join('; ')}`);
  }
}

async function createSession(ort, file, what) {
  if (!existsSync(file)) throw new UsageError(`${what}: file not found: ${file}`);
  try {
    return await ort.InferenceSession.create(file, { executionProviders: ['cpu'], logSeverityLevel: 3 });
  } catch (e) {
    throw new CheckError(`${what}: onnxruntime rejected ${file}: ${String(e.message || e).split('\n')[0]}`);
  }
}

// What the JSON line reports when a CheckError stops the run early.
const ctx = { model: null, stages: null };

async function main() {
  const opt = parseArgs(process.argv.slice(2));
  const plan = readJson(opt.plan);
  validatePlan(plan, opt.plan);
  if (opt.model && !existsSync(opt.model)) throw new UsageError(`model file not found: ${opt.model}`);
  const planDir = path.dirname(path.resolve(opt.plan));
  const stageFiles = plan.stages.map((s) => path.resolve(planDir, s.files[0]));
  for (const [k, f] of stageFiles.entries()) {
    if (!existsSync(f)) throw new UsageError(`stage ${k}: file not found: ${f}`);
  }

  let ort;
  try {
    ort = (await import('onnxruntime-node')).default;
  } catch (e) {
    throw new UsageError(`cannot load onnxruntime-node (run: ONNXRUNTIME_NODE_INSTALL=skip npm ci --prefix tests/ort): ${e.message}`);
  }
  ctx.model = opt.model ?? plan.model ?? null;
  ctx.stages = plan.stages.length;
  const report = { model: ctx.model, stages: ctx.stages };

  if (opt.checkOnly) {
    for (const [k, f] of stageFiles.entries()) {
      const s = await createSession(ort, f, `stage ${k}`);
      checkDeclared(k, 'inputs', plan.stages[k].inputs, s.inputNames);
      checkDeclared(k, 'outputs', plan.stages[k].outputs, s.outputNames);
      await s.release();
    }
    return { ...report, check_only: true, ok: true };
  }

  // Full model.
  const full = await createSession(ort, opt.model, 'full model');
  const meta = Array.isArray(full.inputMetadata) ? full.inputMetadata : null;
  const stage0In = new Map(plan.stages[0].inputs.map((t) => [t.name, t]));
  const feeds = {};
  full.inputNames.forEach((name, idx) => {
    const m = meta?.find((x) => x.name === name);
    const p = stage0In.get(name);
    const shape = (m && m.isTensor && Array.isArray(m.shape)) ? m.shape : p?.shape;
    const dtype = (m && m.isTensor && m.type) ? m.type : (p?.dtype ?? 'float32');
    if (!Array.isArray(shape)) throw new UsageError(`full model input '${name}': shape unknown (not in session metadata nor in plan stage 0)`);
    const dims = resolveShape(name, shape, opt, p?.shape);
    feeds[name] = makeInput(ort, name, dtype, dims, opt.seed, idx);
  });
  const fullOut = await full.run(feeds);
  const outNames = full.outputNames.slice();
  await full.release();

  // Chain the stages.
  const values = new Map(Object.entries(feeds));
  for (const [k, f] of stageFiles.entries()) {
    const st = plan.stages[k];
    const s = await createSession(ort, f, `stage ${k}`);
    checkDeclared(k, 'inputs', st.inputs, s.inputNames);
    checkDeclared(k, 'outputs', st.outputs, s.outputNames);
    const sf = {};
    for (const t of st.inputs) {
      if (!values.has(t.name)) {
        throw new CheckError(`stage ${k} needs input '${t.name}', which neither the model inputs nor an earlier stage provide`);
      }
      sf[t.name] = values.get(t.name);
    }
    let out;
    try {
      out = await s.run(sf, st.outputs.map((t) => t.name));
    } catch (e) {
      throw new CheckError(`stage ${k}: run failed: ${String(e.message || e).split('\n')[0]}`);
    }
    for (const t of st.outputs) {
      const v = out[t.name];
      if (t.dtype !== undefined && v.type !== t.dtype) {
        throw new CheckError(`stage ${k} output '${t.name}': plan says ${t.dtype}, file produced ${v.type}`);
      }
      if (Array.isArray(t.shape)) {
        const okShape = t.shape.length === v.dims.length && t.shape.every((d, j) =>
          typeof d === 'number' ? d === v.dims[j] : (d === 'batch' && !('batch' in opt.dims) ? v.dims[j] === opt.batch : true));
        if (!okShape) {
          throw new CheckError(`stage ${k} output '${t.name}': plan shape ${JSON.stringify(t.shape)}, got [${v.dims}]`);
        }
      }
      values.set(t.name, v);
    }
    await s.release();
  }

  // Compare.
  let maxAbs = 0;
  const failures = [];
  for (const name of outNames) {
    if (!values.has(name)) {
      failures.push(`full-model output '${name}' is not produced by any stage`);
      maxAbs = Infinity;
      continue;
    }
    const r = compareTensors(name, values.get(name), fullOut[name], opt.rtol, opt.atol);
    if (r.maxAbs > maxAbs) maxAbs = r.maxAbs;
    if (!r.ok) failures.push(r.why);
  }
  for (const f of failures) process.stderr.write(`chain_check: ${f}\n`);
  return { ...report, max_abs_diff: Number.isFinite(maxAbs) ? maxAbs : null, ok: failures.length === 0 };
}

let code;
try {
  const report = await main();
  process.stdout.write(JSON.stringify(report) + '\n');
  code = report.ok ? 0 : 1;
} catch (e) {
  if (e instanceof UsageError) {
    process.stderr.write(`chain_check: ${e.message}\n`);
    code = 2;
  } else if (e instanceof CheckError) {
    process.stderr.write(`chain_check: ${e.message}\n`);
    process.stdout.write(JSON.stringify({ ...ctx, max_abs_diff: null, ok: false, error: e.message }) + '\n');
    code = 1;
  } else {
    process.stderr.write(`chain_check: internal error: ${e && e.stack ? e.stack : e}\n`);
    code = 2;
  }
}
process.exitCode = code;
