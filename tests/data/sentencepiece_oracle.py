"""The reference for outcore's SentencePiece path: Debian's python3-sentencepiece.

    sentencepiece_oracle.py train TEXT MODEL_PREFIX MODEL_TYPE VOCAB_SIZE
    sentencepiece_oracle.py encode MODEL DOCS_JSONL OUT

train: trains a model (bpe or unigram, byte fallback on, as Llama 2's) on TEXT (one sentence a
line), writing MODEL_PREFIX.model. encode: for each line of DOCS_JSONL ({"text": ...}), writes
to OUT a little-endian uint32 count followed by [bos] + encode(text) + [eos].
"""
import json
import struct
import sys

import sentencepiece as spm


def train(text, prefix, model_type, vocab_size):
    spm.SentencePieceTrainer.train(
        input=text, model_prefix=prefix, model_type=model_type, vocab_size=int(vocab_size),
        character_coverage=0.9995, byte_fallback=True, num_threads=2,
        max_sentence_length=1 << 16, minloglevel=2)


def encode(model, docs, out):
    sp = spm.SentencePieceProcessor(model_file=model)
    with open(docs, encoding="utf-8") as f, open(out, "wb") as o:
        for line in f:
            ids = [sp.bos_id()] + sp.encode(json.loads(line)["text"]) + [sp.eos_id()]
            o.write(struct.pack("<I", len(ids)))
            o.write(struct.pack("<%dI" % len(ids), *ids))


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(*sys.argv[2:6])
    else:
        encode(*sys.argv[2:5])
