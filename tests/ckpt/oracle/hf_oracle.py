#!/usr/bin/python3
"""Hugging Face Llama directories written and read without outcore, for tests/ckpt.

Usage:
  hf_oracle.py make CASE_DIR [CASE_DIR ...]
  hf_oracle.py logits HF_DIR TOKENS_BIN BATCH SEQ OUT_BIN
  hf_oracle.py loss HF_DIR INPUTS_BIN TARGETS_BIN MICRO_BATCH SEQ OUT_BIN

make: CASE_DIR/case.json is
  {"config": {HF config.json keys}, "dtype": "float32"|"bfloat16"|"float16",
   "shards": N, "seed": S, "batch": B, "seq": T,
   "extra_tensors": [names of F32 [4] tensors to add, e.g. a rotary_emb.inv_freq],
   "save_lm_head": true to store lm_head.weight even when embeddings are tied}
and CASE_DIR/tokens.bin holds int32 [B*T] ids. Writes a random model as CASE_DIR/hf/
(config.json and model.safetensors, or N shards plus model.safetensors.index.json) and the
float64 logits [B*T, vocab] of those stored weights for the tokens as CASE_DIR/logits.bin.

logits: loads HF_DIR (single file or sharded) with the reader below and writes the float64
logits of TOKENS_BIN ([BATCH, SEQ] int32) to OUT_BIN.

loss: loads HF_DIR likewise; INPUTS_BIN and TARGETS_BIN hold int32 [N, SEQ] ids, N a multiple of
MICRO_BATCH. Writes to OUT_BIN the float64 mean cross-entropy of each micro-batch of MICRO_BATCH
consecutive sequences (N / MICRO_BATCH values), as a training loop's evaluation computes it.

safetensors is read and written here from its specification with json + struct (the
safetensors package is not needed); the forward pass is tests/model/oracle/llama_oracle.py's.
"""
import json
import math
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "model",
                                "oracle"))
import llama_oracle  # noqa: E402  (float64 reference forward)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
ST_DTYPES = {v: k for k, v in ST_NAMES.items()}


def tensor_bytes(t):
    flat = t.contiguous().reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        flat = flat.view(torch.int16)
    return flat.numpy().tobytes()


def write_safetensors(path, tensors):
    """tensors: dict name -> torch tensor; data in sorted name order."""
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        data = tensor_bytes(t)
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:end]), dtype=ST_DTYPES[e["dtype"]]) if end > b else \
            torch.zeros(0, dtype=ST_DTYPES[e["dtype"]])
        out[name] = t.reshape(e["shape"])
    return out


def load_hf_dir(hf_dir):
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.exists(single):
        tensors = read_safetensors(single)
    else:
        with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
            index = json.load(f)
        tensors = {}
        for shard in sorted(set(index["weight_map"].values())):
            tensors.update(read_safetensors(os.path.join(hf_dir, shard)))
        assert set(tensors) == set(index["weight_map"]), "index and shards disagree"
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    return cfg, {k: v.to(torch.float64) for k, v in tensors.items()}


def model_shapes(cfg):
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = [v, h]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                       p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
                       p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
                       p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
                       p + "mlp.down_proj.weight": [h, inter]})
    return shapes


def with_defaults(cfg):
    cfg = dict(cfg)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def random_weights(cfg, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in model_shapes(cfg).items():
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        out[name] = (1.0 + 0.2 * x if "norm" in name else 0.15 * x).to(dtype)
    return out


def logits_of(cfg, params, tokens):
    logits, _ = llama_oracle.forward(with_defaults(cfg), params, tokens, tokens)
    return logits.detach()


def micro_batch_losses(cfg, params, inputs, targets, micro_batch):
    cfg = with_defaults(cfg)
    losses = []
    for b in range(0, inputs.shape[0], micro_batch):
        _, loss = llama_oracle.forward(cfg, params, inputs[b:b + micro_batch],
                                       targets[b:b + micro_batch])
        losses.append(loss.detach().reshape(1))
    return torch.cat(losses)


def write_sharded(hf_dir, tensors, n):
    names = sorted(tensors)
    per = math.ceil(len(names) / n)
    weight_map, total = {}, 0
    for i in range(n):
        shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: tensors[k] for k in names[i * per:(i + 1) * per]}
        write_safetensors(os.path.join(hf_dir, shard), part)
        for k, t in part.items():
            weight_map[k] = shard
            total += len(tensor_bytes(t))
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def make_case(case_dir):
    with open(os.path.join(case_dir, "case.json")) as f:
        case = json.load(f)
    cfg = with_defaults(case["config"])
    dtype = TORCH_DTYPES[case["dtype"]]
    weights = random_weights(cfg, dtype, case["seed"])
    stored = dict(weights)
    for name in case.get("extra_tensors", []):
        stored[name] = torch.arange(4, dtype=torch.float32)
    if case.get("save_lm_head") and cfg.get("tie_word_embeddings"):
        stored["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    hf_dir = os.path.join(case_dir, "hf")
    os.makedirs(hf_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(dict(case["config"], torch_dtype=case["dtype"]), f, indent=2)
    if case["shards"] > 1:
        write_sharded(hf_dir, stored, case["shards"])
    else:
        write_safetensors(os.path.join(hf_dir, "model.safetensors"), stored)
    tokens = read_tokens(os.path.join(case_dir, "tokens.bin"), case["batch"], case["seq"])
    params = {k: v.to(torch.float64) for k, v in weights.items()}
    with open(os.path.join(case_dir, "logits.bin"), "wb") as f:
        f.write(logits_of(cfg, params, tokens).numpy().tobytes())


def read_tokens(path, batch, seq):
    """int32 ids as int64 [batch, seq]; batch -1: as many rows as the file holds."""
    with open(path, "rb") as f:
        data = f.read()
    return torch.frombuffer(bytearray(data), dtype=torch.int32).to(torch.int64).reshape(batch, seq)


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "make":
        for case_dir in sys.argv[2:]:
            make_case(case_dir)
        return 0
    if len(sys.argv) == 7 and sys.argv[1] == "logits":
        cfg, params = load_hf_dir(sys.argv[2])
        tokens = read_tokens(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        with open(sys.argv[6], "wb") as f:
            f.write(logits_of(cfg, params, tokens).numpy().tobytes())
        return 0
    if len(sys.argv) == 8 and sys.argv[1] == "loss":
        cfg, params = load_hf_dir(sys.argv[2])
        micro_batch, seq = int(sys.argv[5]), int(sys.argv[6])
        inputs = read_tokens(sys.argv[3], -1, seq)
        targets = read_tokens(sys.argv[4], -1, seq)
        if inputs.shape != targets.shape or inputs.shape[0] % micro_batch != 0:
            print(f"loss: inputs {list(inputs.shape)} and targets {list(targets.shape)} do not "
                  f"form micro-batches of {micro_batch}", file=sys.stderr)
            return 2
        with open(sys.argv[7], "wb") as f:
            f.write(micro_batch_losses(cfg, params, inputs, targets, micro_batch).numpy().tobytes())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
