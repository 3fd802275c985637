#!/usr/bin/env node
// Reference evaluator: run an ONNX model with onnxruntime-node on one .npy input.
//
//   node tests/ort/eval.mjs MODEL.onnx INPUT.npy OUTPUT.npy
//
// The model must have exactly one input; INPUT.npy ('<f4' or '<i8', C order)
// is fed to it, and the model's first output is written to OUTPUT.npy as
// float32. Exit status: 0 ok, 1 onnxruntime rejected the model or the run
// failed, 2 usage or file errors.

import { existsSync } from 'node:fs';
import process from 'node:process';
import { readNpy, writeNpy } from './npy.mjs';

const USAGE = 'usage: node tests/ort/eval.mjs MODEL.onnx INPUT.npy OUTPUT.npy';

class UsageError extends Error {}
class RunError extends Error {}

const firstLine = (e) => String((e && e.message) || e).split('\n')[0];

async function main(argv) {
  if (argv.length !== 3) throw new UsageError(USAGE);
  const [modelPath, inPath, outPath] = argv;
  if (!existsSync(modelPath)) throw new UsageError(`model file not found: ${modelPath}`);
  if (!existsSync(inPath)) throw new UsageError(`input file not found: ${inPath}`);
  let input;
  try {
    input = readNpy(inPath);
  } catch (e) {
    throw new UsageError(`${inPath}: ${firstLine(e)}`);
  }

  let ort;
  try {
    ort = (await import('onnxruntime-node')).default;
  } catch (e) {
    throw new UsageError(`cannot load onnxruntime-node (run: ONNXRUNTIME_NODE_INSTALL=skip npm ci --prefix tests/ort): ${firstLine(e)}`);
  }
  let session;
  try {
    session = await ort.InferenceSession.create(modelPath, { executionProviders: ['cpu'], logSeverityLevel: 3 });
  } catch (e) {
    throw new RunError(`onnxruntime rejected ${modelPath}: ${firstLine(e)}`);
  }
  if (session.inputNames.length !== 1) {
    throw new UsageError(`${modelPath} has ${session.inputNames.length} inputs (${session.inputNames.join(', ')}); eval.mjs needs exactly one`);
  }
  const inName = session.inputNames[0];
  const meta = Array.isArray(session.inputMetadata) ? session.inputMetadata.find((m) => m.name === inName) : null;
  if (meta && meta.isTensor && meta.type && meta.type !== input.dtype) {
    throw new UsageError(`input '${inName}' wants ${meta.type}, ${inPath} holds ${input.dtype}`);
  }
  const outName = session.outputNames[0];
  let out;
  try {
    const res = await session.run({ [inName]: new ort.Tensor(input.dtype, input.data, input.shape) }, [outName]);
    out = res[outName];
  } catch (e) {
    throw new RunError(`run failed: ${firstLine(e)}`);
  }
  let data;
  if (out.type === 'float32') {
    data = out.data;
  } else if (['float64', 'int8', 'uint8', 'int16', 'uint16', 'int32', 'uint32', 'int64', 'uint64', 'bool'].includes(out.type)) {
    data = Float32Array.from(out.data, (x) => Number(x));
  } else {
    throw new RunError(`output '${outName}' has type ${out.type}, which cannot be written as float32`);
  }
  try {
    writeNpy(outPath, { dtype: 'float32', shape: Array.from(out.dims), data });
  } catch (e) {
    throw new UsageError(`cannot write ${outPath}: ${firstLine(e)}`);
  }
  await session.release();
}

try {
  await main(process.argv.slice(2));
  process.exitCode = 0;
} catch (e) {
  process.stderr.write(`eval: ${e instanceof UsageError || e instanceof RunError ? e.message : firstLine(e)}\n`);
  process.exitCode = e instanceof RunError ? 1 : 2;
}
