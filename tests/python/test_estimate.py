"""outcore.estimate: the placement plan of a DeepSpeed config and a Llama config, from files or
dicts, as a dict; bad input raises ConfigError / IoError naming the source and JSON path."""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

from oracle import import_torch_and_outcore

torch, outcore = import_torch_and_outcore()

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}}}


def llama_parameters(m):
    h, i, v = m["hidden_size"], m["intermediate_size"], m["vocab_size"]
    head_dim = h // m["num_attention_heads"]
    q, kv = m["num_attention_heads"] * head_dim, m["num_key_value_heads"] * head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return v * h + m["num_hidden_layers"] * layer + h + (0 if m["tie_word_embeddings"] else v * h)


class Estimate(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="outcore_py_estimate_")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def write(self, name, obj):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(obj if isinstance(obj, str) else json.dumps(obj))
        return path

    def test_plan_of_stage3_cpu_offload(self):
        plan = outcore.estimate(CONFIG, MODEL)
        self.assertEqual(plan["num_parameters"], llama_parameters(MODEL))
        p = plan["placement"]
        self.assertEqual((p["stage"], p["param_dtype"]), (3, "bf16"))
        self.assertIn(p["params"], ("pinned", "host"))
        self.assertIn(p["optimizer"], ("pinned", "host"))
        self.assertEqual(plan["micro_batches_per_step"], 4)
        self.assertEqual(plan["tokens_per_micro_batch"], 2 * 512)
        self.assertTrue(plan["fits"])
        self.assertIsNone(plan["does_not_fit"])
        # fp32 master weights and Adam moments: 12 bytes per parameter, somewhere off-device.
        off_device = plan["peak"]["pinned"] + plan["peak"]["host"]
        self.assertGreaterEqual(off_device, 12 * plan["num_parameters"])
        self.assertEqual(sum(i["bytes"] for i in plan["items"] if i["tier"] == "host"),
                         plan["peak"]["host"])
        self.assertEqual(plan["per_step"]["nvme_read"], 0)
        self.assertIn("pinned", plan["table"])

    def test_files_and_dicts_give_the_same_plan(self):
        a = outcore.estimate(self.write("ds.json", CONFIG), self.write("config.json", MODEL))
        b = outcore.estimate(CONFIG, MODEL)
        for key in ("placement", "peak", "items", "per_step", "num_parameters", "budgets"):
            self.assertEqual(a[key], b[key], key)

    def test_world_size_partitions_the_optimizer_state(self):
        one = outcore.estimate(CONFIG, MODEL, world_size=1)
        two = outcore.estimate(CONFIG, MODEL, world_size=2, micro_batch=2)
        self.assertEqual(two["world_size"], 2)
        self.assertEqual(two["num_parameters"], one["num_parameters"])
        master = [i["bytes"] for i in one["items"] if "master" in i["what"]]
        master2 = [i["bytes"] for i in two["items"] if "master" in i["what"]]
        self.assertTrue(master and master2)
        self.assertLess(sum(master2), 0.6 * sum(master))

    def test_shipped_config_file_with_comments(self):
        plan = outcore.estimate(os.path.join(SOURCE_DIR, "configs", "zero3_cpu_offload.json"),
                                MODEL)
        self.assertEqual(plan["placement"]["stage"], 3)

    def test_same_plan_as_the_outcore_estimate_command(self):
        cli = os.environ.get("OUTCORE_CLI", "")
        if not os.path.exists(cli):
            self.skipTest(f"the outcore tool is not built ({cli or 'OUTCORE_CLI unset'})")
        config = os.path.join(SOURCE_DIR, "configs", "zero3_nvme_infinity.json")
        model = self.write("config.json", MODEL)
        for world in (1, 2):
            out = subprocess.run([cli, "estimate", "--config", config, "--model", model,
                                  "--world-size", str(world), "--micro-batch", "2"],
                                 capture_output=True, text=True)
            plan = outcore.estimate(config, model, world_size=world, micro_batch=2)
            # Limits (MemAvailable, free disk space) are read anew by each: compare the rest.
            same = lambda text: [l.split("  limit ")[0] for l in text.splitlines()]
            # The command goes on with the step's bounds, measured here: the plan comes first.
            table = out.stdout.split("\n\nstep bounds")[0]
            if plan["fits"]:
                self.assertIn("step bounds", out.stdout)
            self.assertEqual(same(plan["table"]), same(table), out.stderr)
            self.assertEqual(out.returncode, 0 if plan["fits"] else 2)

    def test_a_plan_that_does_not_fit_says_why(self):
        cfg = dict(CONFIG, zero_optimization={"stage": 0}, outcore={"device_memory_mb": 1})
        plan = outcore.estimate(cfg, MODEL)
        self.assertFalse(plan["fits"])
        self.assertIn("device", plan["does_not_fit"])

    def test_bad_input_names_the_source_and_key(self):
        with self.assertRaises(outcore.ConfigError) as cm:
            outcore.estimate(dict(CONFIG, zero_optimization={"stage": 7}), MODEL)
        self.assertIn("<config dict>", str(cm.exception))
        self.assertIn("zero_optimization.stage", str(cm.exception))
        bad = self.write("bad.json", '{"train_micro_batch_size_per_gpu": 2,\n "bf16": [}')
        with self.assertRaises(outcore.ConfigError) as cm:
            outcore.estimate(bad, MODEL)
        self.assertIn(bad, str(cm.exception))
        with self.assertRaises(outcore.ConfigError) as cm:
            outcore.estimate(CONFIG, dict(MODEL, hidden_size=-1))
        self.assertIn("hidden_size", str(cm.exception))
        # A file that cannot be read is IoError, the DeepSpeed config's as the model's (the
        # config's was ConfigError).
        missing = os.path.join(self.dir, "missing.json")
        for args in ((CONFIG, missing), (missing, MODEL)):
            with self.assertRaises(outcore.IoError) as cm:
                outcore.estimate(*args)
            self.assertIsInstance(cm.exception, OSError)
            self.assertEqual(cm.exception.filename, missing)
        with self.assertRaises(TypeError):
            outcore.estimate(42, MODEL)
        with self.assertRaises(ValueError):
            outcore.estimate(CONFIG, MODEL, world_size=0)

    def test_sizes_beyond_their_range_are_refused_not_truncated(self):
        # 2**32 + 2 was planned as world size 2 (the int it was cut to).
        for kwargs, name in (({"world_size": 2**32 + 2}, "world_size"),
                             ({"world_size": 2**64 + 2}, "world_size"),
                             ({"world_size": (1 << 20) + 1}, "world_size"),
                             ({"micro_batch": 2**32 + 2}, "micro_batch"),
                             ({"seq_len": 2**64}, "seq_len"),
                             ({"micro_batch": -1}, "micro_batch"),
                             ({"micro_batch": 0}, "micro_batch"),  # once taken as the default
                             ({"seq_len": 0}, "seq_len")):
            with self.assertRaises(ValueError, msg=str(kwargs)) as cm:
                outcore.estimate(CONFIG, MODEL, **kwargs)
            self.assertIn(name, str(cm.exception))
            self.assertIn(str(next(iter(kwargs.values()))), str(cm.exception))
            # The range said is the one a caller may pass (0 is never allowed here).
            self.assertNotIn("in 0..", str(cm.exception))
        self.assertEqual(outcore.estimate(CONFIG, MODEL, world_size=1 << 20,
                                          micro_batch=2)["world_size"], 1 << 20)

    def test_non_integer_sizes_are_refused_not_truncated(self):
        for name, value in (("world_size", 1.7), ("micro_batch", "2"), ("seq_len", 64.0),
                            ("world_size", None), ("world_size", True)):
            with self.assertRaises(TypeError, msg=f"{name}={value!r}") as cm:
                outcore.estimate(CONFIG, MODEL, **{name: value})
            self.assertIn(name, str(cm.exception))
            self.assertIn(repr(value), str(cm.exception))
        self.assertEqual(outcore.estimate(CONFIG, MODEL, micro_batch=None)["world_size"], 1)
        # activation_checkpointing takes True or False only: "no" would have been true.
        for value in ("no", 1, None):
            with self.assertRaises(TypeError, msg=repr(value)) as cm:
                outcore.estimate(CONFIG, MODEL, activation_checkpointing=value)
            self.assertIn("activation_checkpointing", str(cm.exception))

    def test_a_dict_with_nan_or_infinity_names_the_key(self):
        # JSON has neither: the dict's text was refused as "malformed JSON at line 1, column N".
        for bad, path in ((dict(CONFIG, gradient_clipping=float("nan")), "gradient_clipping"),
                          (dict(CONFIG, optimizer={"type": "Adam",
                                                   "params": {"lr": float("inf")}}),
                           "optimizer.params.lr"),
                          (dict(CONFIG, x=[1.0, float("-inf")]), "x[1]")):
            with self.assertRaises(ValueError, msg=path) as cm:
                outcore.estimate(bad, MODEL)
            self.assertIn(f"config_path_or_dict: {path}: got", str(cm.exception))
        with self.assertRaises(TypeError) as cm:
            outcore.estimate(dict(CONFIG, x={1, 2}), MODEL)
        self.assertIn("config_path_or_dict: not a JSON document", str(cm.exception))

    def test_a_dict_nested_too_deep_is_a_value_error(self):
        deep = {}
        inner = deep
        for _ in range(5000):
            inner["x"] = {}
            inner = inner["x"]
        with self.assertRaisesRegex(ValueError, "nested deeper than 256 levels"):
            outcore.estimate(dict(CONFIG, deep=deep), MODEL)

    def test_unknown_keys_are_returned_not_also_printed(self):
        # A library call hands its warnings back; the process's stderr is the caller's.
        with tempfile.TemporaryFile() as err:
            saved = os.dup(2)
            os.dup2(err.fileno(), 2)
            try:
                r = outcore.estimate(dict(CONFIG, not_a_key=1), MODEL)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            err.seek(0)
            printed = err.read().decode()
        self.assertTrue(any("not_a_key" in w for w in r["warnings"]), r["warnings"])
        self.assertNotIn("not_a_key", printed)

    def test_a_path_with_an_embedded_null_byte_is_refused_not_cut_short(self):
        # The C library stops a path at its first null byte: "ds.json\0junk" would read ds.json.
        config = self.write("ds.json", CONFIG)
        model = self.write("config.json", MODEL)
        for args in ((config + "\0junk", model), (config, model + "\0")):
            with self.assertRaisesRegex(ValueError, "embedded null byte") as cm:
                outcore.estimate(*args)
            self.assertNotIn("\0", str(cm.exception))
        with self.assertRaisesRegex(ValueError, "embedded null byte"):
            outcore._outcore.estimate(config + "\0junk", True, model, True, 1, 0, 0, False)
        self.assertEqual(outcore.estimate(config, model)["placement"]["stage"], 3)

    def test_bytes_that_are_not_utf8_in_files_and_names(self):
        # A config with a byte that is not UTF-8 is a ConfigError naming the file (its message
        # keeps the byte as a surrogate, as os.fsdecode does), not a UnicodeDecodeError; a file
        # whose name is not UTF-8 (a str from os.listdir) is read.
        model = self.write("config.json", MODEL)
        bad = os.path.join(self.dir, "bad.json")
        with open(bad, "wb") as f:
            f.write(b'{"train_micro_batch_size_per_gpu": 1, "\xff": 2}')
        with self.assertRaises(outcore.ConfigError) as cm:
            outcore.estimate(bad, model)
        self.assertIn(bad, str(cm.exception))
        odd = os.fsdecode(os.path.join(os.fsencode(self.dir), b"\xfe.json"))
        with open(odd, "w") as f:
            json.dump(CONFIG, f)
        self.assertEqual(outcore.estimate(odd, model)["placement"]["stage"], 3)


if __name__ == "__main__":
    unittest.main()
