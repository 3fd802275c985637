// Minimal NumPy .npy reader/writer for pipeshard's onnxruntime cross-checks.
//
// Supported: format versions 1.0, 2.0 and 3.0 (3.0 only differs in allowing
// UTF-8 in the header), little-endian '<f4' (float32) and '<i8' (int64),
// C order ('fortran_order': False). Anything else is rejected with an Error.
//
// readNpy(path)            -> { dtype: 'float32'|'int64', shape: number[], data: Float32Array|BigInt64Array }
// parseNpy(buffer)         -> same, from a Buffer/Uint8Array
// writeNpy(path, arr)      -> writes arr = { dtype, shape, data } as version 1.0 (2.0 if the header is huge)
// encodeNpy(arr)           -> Buffer

import { readFileSync, writeFileSync } from 'node:fs';

const MAGIC = Buffer.from([0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59]); // "\x93NUMPY"

const DESCR_TO_DTYPE = { '<f4': 'float32', '<i8': 'int64' };
const DTYPE_TO_DESCR = { float32: '<f4', int64: '<i8' };
const ITEMSIZE = { float32: 4, int64: 8 };

function fail(msg) {
  throw new Error(`npy: ${msg}`);
}

// Parses the Python-literal dict used in .npy headers, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (3, 100), }
// Only the exact subset numpy writes is accepted.
function parseHeaderDict(text) {
  const s = text.trim();
  let i = 0;
  const ws = () => { while (i < s.length && /\s/.test(s[i])) i++; };
  const expect = (ch) => {
    ws();
    if (s[i] !== ch) fail(`header: expected '${ch}' at offset ${i} in ${JSON.stringify(text)}`);
    i++;
  };
  const parseString = () => {
    ws();
    const q = s[i];
    if (q !== "'" && q !== '"') fail(`header: expected string at offset ${i}`);
    const end = s.indexOf(q, i + 1);
    if (end < 0) fail('header: unterminated string');
    const v = s.slice(i + 1, end);
    i = end + 1;
    return v;
  };
  const parseValue = () => {
    ws();
    if (s[i] === "'" || s[i] === '"') return parseString();
    if (s.startsWith('True', i)) { i += 4; return true; }
    if (s.startsWith('False', i)) { i += 5; return false; }
    if (s[i] === '(') {
      i++;
      const dims = [];
      for (;;) {
        ws();
        if (s[i] === ')') { i++; break; }
        const m = /^[0-9]+/.exec(s.slice(i));
        if (!m) fail(`header: bad shape entry at offset ${i} in ${JSON.stringify(text)}`);
        const n = Number(m[0]);
        if (!Number.isSafeInteger(n)) fail('header: shape entry too large');
        dims.push(n);
        i += m[0].length;
        ws();
        if (s[i] === ',') { i++; continue; }
        if (s[i] === ')') { i++; break; }
        fail(`header: bad shape tuple in ${JSON.stringify(text)}`);
      }
      return dims;
    }
    fail(`header: unsupported value at offset ${i} in ${JSON.stringify(text)}`);
    return undefined;
  };

  const out = {};
  expect('{');
  for (;;) {
    ws();
    if (s[i] === '}') { i++; break; }
    const key = parseString();
    expect(':');
    if (Object.prototype.hasOwnProperty.call(out, key)) fail(`header: duplicate key '${key}'`);
    out[key] = parseValue();
    ws();
    if (s[i] === ',') { i++; continue; }
    if (s[i] === '}') { i++; break; }
    fail(`header: expected ',' or '}' at offset ${i}`);
  }
  ws();
  if (i !== s.length) fail('header: trailing characters after dict');
  return out;
}

export function parseNpy(buf) {
  const b = Buffer.isBuffer(buf) ? buf : Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength);
  if (b.length < 10 || !b.subarray(0, 6).equals(MAGIC)) fail('not a .npy file (bad magic)');
  const major = b[6];
  const minor = b[7];
  let headerLen;
  let offset;
  if (major === 1) {
    headerLen = b.readUInt16LE(8);
    offset = 10;
  } else if (major === 2 || major === 3) {
    if (b.length < 12) fail('truncated header');
    headerLen = b.readUInt32LE(8);
    offset = 12;
  } else {
    fail(`unsupported format version ${major}.${minor}`);
  }
  if (minor !== 0) fail(`unsupported format version ${major}.${minor}`);
  if (offset + headerLen > b.length) fail('truncated header');
  const header = b.subarray(offset, offset + headerLen).toString(major === 3 ? 'utf8' : 'latin1');
  const dict = parseHeaderDict(header);
  for (const k of Object.keys(dict)) {
    if (!['descr', 'fortran_order', 'shape'].includes(k)) fail(`header: unexpected key '${k}'`);
  }
  if (typeof dict.descr !== 'string') fail('header: missing descr');
  if (typeof dict.fortran_order !== 'boolean') fail('header: missing fortran_order');
  if (!Array.isArray(dict.shape)) fail('header: missing shape');
  const dtype = DESCR_TO_DTYPE[dict.descr];
  if (!dtype) fail(`unsupported dtype '${dict.descr}' (only '<f4' and '<i8')`);
  if (dict.fortran_order) fail('fortran_order=True is not supported');

  const shape = dict.shape;
  const count = shape.reduce((a, d) => a * d, 1);
  if (!Number.isSafeInteger(count)) fail('element count too large');
  const dataStart = offset + headerLen;
  const nbytes = count * ITEMSIZE[dtype];
  if (b.length - dataStart !== nbytes) {
    fail(`data size mismatch: header says ${nbytes} bytes (shape [${shape}] ${dict.descr}), file has ${b.length - dataStart}`);
  }
  // Copy into a fresh, aligned ArrayBuffer (the header length need not keep
  // the data 8-byte aligned relative to Buffer pooling).
  const ab = new ArrayBuffer(nbytes);
  new Uint8Array(ab).set(b.subarray(dataStart, dataStart + nbytes));
  if (!isLittleEndianHost()) fail('big-endian hosts are not supported');
  const data = dtype === 'float32' ? new Float32Array(ab) : new BigInt64Array(ab);
  return { dtype, shape, data };
}

export function readNpy(path) {
  return parseNpy(readFileSync(path));
}

function isLittleEndianHost() {
  return new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
}

export function encodeNpy({ dtype, shape, data }) {
  const descr = DTYPE_TO_DESCR[dtype];
  if (!descr) fail(`cannot write dtype '${dtype}' (only float32 and int64)`);
  if (!Array.isArray(shape) || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
    fail(`bad shape ${JSON.stringify(shape)}`);
  }
  const count = shape.reduce((a, d) => a * d, 1);
  const want = dtype === 'float32' ? Float32Array : BigInt64Array;
  if (!(data instanceof want)) fail(`data must be a ${want.name} for dtype ${dtype}`);
  if (data.length !== count) fail(`data has ${data.length} elements, shape [${shape}] needs ${count}`);
  if (!isLittleEndianHost()) fail('big-endian hosts are not supported');

  const shapeStr = shape.length === 1 ? `(${shape[0]},)` : `(${shape.join(', ')})`;
  const dict = `{'descr': '${descr}', 'fortran_order': False, 'shape': ${shapeStr}, }`;
  // Pad with spaces so that magic + version + len + header (ending in '\n') is a multiple of 64.
  let version = 1;
  let prefix = 10;
  let total = Math.ceil((prefix + dict.length + 1) / 64) * 64;
  if (total - prefix > 0xffff) {
    version = 2;
    prefix = 12;
    total = Math.ceil((prefix + dict.length + 1) / 64) * 64;
  }
  const headerLen = total - prefix;
  const header = dict + ' '.repeat(headerLen - dict.length - 1) + '\n';
  const out = Buffer.alloc(total + data.byteLength);
  MAGIC.copy(out, 0);
  out[6] = version;
  out[7] = 0;
  if (version === 1) out.writeUInt16LE(headerLen, 8);
  else out.writeUInt32LE(headerLen, 8);
  out.write(header, prefix, 'latin1');
  Buffer.from(data.buffer, data.byteOffset, data.byteLength).copy(out, total);
  return out;
}

export function writeNpy(path, arr) {
  writeFileSync(path, encodeNpy(arr));
}
