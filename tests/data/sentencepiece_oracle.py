"""The reference for outcore's SentencePiece path: Debian's python3-sentencepiece.

    sentencepiece_oracle.py train TEXT MODEL_PREFIX MODEL_TYPE VOCAB_SIZE
    sentencepiece_oracle.py encode MODEL DOCS_JSONL OUT [SPLIT_JSON]

train: trains a model (bpe or unigram, byte fallback on, as Llama 2's) on TEXT (one sentence a
line), writing MODEL_PREFIX.model. encode: for each line of DOCS_JSONL ({"text": ...}), writes
to OUT a little-endian uint32 count followed by [bos] + encode(text) + [eos] (no eos when the
encoding ends with it). With SPLIT_JSON (a
JSON list of [content, id]), the text is first split around those tokens as Hugging Face's
tokenizers split out added tokens (leftmost match, the longest of those starting there, no
whitespace stripped): each stretch between them is encoded on its own, each token is its id.
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


def split_encode(sp, text, split):
    ids, start, i = [], 0, 0
    while i < len(text):
        match = max((t for t in split if text.startswith(t[0], i)), key=lambda t: len(t[0]),
                    default=None)
        if match is None:
            i += 1
            continue
        if start < i:
            ids += sp.encode(text[start:i])
        ids.append(match[1])
        i = start = i + len(match[0])
    if start < len(text):
        ids += sp.encode(text[start:])
    return ids


def encode(model, docs, out, split_json=None):
    sp = spm.SentencePieceProcessor(model_file=model)
    split = json.loads(split_json) if split_json else []
    with open(docs, encoding="utf-8") as f, open(out, "wb") as o:
        for line in f:
            text = json.loads(line)["text"]
            ids = [sp.bos_id()] + split_encode(sp, text, split)
            if ids[-1] != sp.eos_id():  # a document ending in EOS takes no second one
                ids.append(sp.eos_id())
            o.write(struct.pack("<I", len(ids)))
            o.write(struct.pack("<%dI" % len(ids), *ids))


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(*sys.argv[2:6])
    else:
        encode(*sys.argv[2:6])
