// The reference for outcore's tokenizer: Hugging Face tokenizers (native, through
// @anush008/tokenizers) encoding the same documents.
//
//   node encode.js DOCS [--no-special] TOKENIZER_JSON OUT [TOKENIZER_JSON OUT ...]
//
// DOCS holds documents separated by NUL bytes; each is decoded with TextDecoder (ill-formed
// UTF-8 becomes U+FFFD, the WHATWG rule). For each tokenizer, OUT receives, per document, a
// little-endian uint32 count followed by that many uint32 ids. Encoding uses encodeBatch, whose
// threads RAYON_NUM_THREADS sets. One JSON line per tokenizer on stdout: the seconds spent in
// encodeBatch and the tokens it produced.
'use strict';
const fs = require('fs');
const path = require('path');
const {Tokenizer} = require('@anush008/tokenizers');

const kBatchDocs = 2000;

function splitDocuments(bytes) {
  const decoder = new TextDecoder('utf-8', {fatal: false});
  const docs = [];
  let start = 0;
  for (;;) {
    const end = bytes.indexOf(0, start);
    docs.push(decoder.decode(bytes.subarray(start, end < 0 ? bytes.length : end)));
    if (end < 0) break;
    start = end + 1;
  }
  return docs;
}

async function encodeAll(tokenizerPath, docs, addSpecialTokens, outPath) {
  const tokenizer = Tokenizer.fromFile(tokenizerPath);
  const parts = [];
  let seconds = 0;
  let tokens = 0;
  for (let b = 0; b < docs.length; b += kBatchDocs) {
    const batch = docs.slice(b, b + kBatchDocs);
    const t0 = process.hrtime.bigint();
    const encodings = await tokenizer.encodeBatch(batch, {addSpecialTokens});
    const ids = encodings.map((e) => e.getIds());
    seconds += Number(process.hrtime.bigint() - t0) / 1e9;
    for (const list of ids) {
      const buf = Buffer.alloc(4 * (list.length + 1));
      buf.writeUInt32LE(list.length, 0);
      for (let i = 0; i < list.length; ++i) buf.writeUInt32LE(list[i], 4 * (i + 1));
      parts.push(buf);
      tokens += list.length;
    }
  }
  fs.writeFileSync(outPath, Buffer.concat(parts));
  return {tokenizer: path.resolve(tokenizerPath), seconds, tokens, documents: docs.length};
}

async function main() {
  const args = process.argv.slice(2);
  if (args.length < 3) {
    console.error('usage: node encode.js DOCS [--no-special] TOKENIZER_JSON OUT [...]');
    process.exit(2);
  }
  const docs = splitDocuments(fs.readFileSync(args.shift()));
  let addSpecialTokens = true;
  if (args[0] === '--no-special') {
    addSpecialTokens = false;
    args.shift();
  }
  for (let i = 0; i + 1 < args.length; i += 2) {
    const result = await encodeAll(args[i], docs, addSpecialTokens, args[i + 1]);
    console.log(JSON.stringify(result));
  }
}

main().catch((e) => {
  console.error(e && e.stack ? e.stack : String(e));
  process.exit(1);
});
