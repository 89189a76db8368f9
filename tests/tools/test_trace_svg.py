"""tools/trace_svg.py: a Chrome trace (as common/trace.cpp writes it) becomes an SVG that parses
as XML, with one row per track that has a span in the window and one rectangle per span in it,
nested spans a level lower; the default window is the last step; bad input exits non-zero with
one line on stderr."""
import json
import os
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "tools", "trace_svg.py")
SVG = "{http://www.w3.org/2000/svg}"
PID = 4242

# tid -> thread name (tid 4 has none); spans as (tid, name, cat, start s, end s, args).
TRACKS = {1: "trainer", 2: "aio #0", 3: "aio #1", 5: "zero-step", 6: "zero-step"}
SPANS = [
    (1, "step", "step", 0.0, 1.0, {"index": 1}),
    (1, "forward", "compute", 0.1, 0.4, {"unit": 1}),
    (1, "backward", "compute", 0.5, 0.9, {"unit": 1}),
    (4, "adam", "optimizer", 0.2, 0.3, {}),
    (2, "read", "io", 0.95, 1.05, {"bytes": 4096, "file": "a<b>.bin"}),
    (1, "step", "step", 1.0, 2.0, {"index": 2}),
    (5, "adam", "optimizer", 1.0, 1.1, {"unit": 0}),
    (1, "forward", "compute", 1.1, 1.3, {"unit": 1}),
    (1, "param wait", "wait", 1.15, 1.2, {"unit": 1}),
    (3, "read", "io", 1.2, 1.25, {"bytes": 8192}),
    (1, "backward", "compute", 1.4, 1.9, {"unit": 1}),
    (2, "write", "io", 1.5, 1.6, {"bytes": 4096}),
    (6, "adam", "optimizer", 1.6, 1.7, {"unit": 1}),
]


def trace_json():
    events = [{"ph": "M", "pid": PID, "tid": 0, "name": "process_name",
               "args": {"name": "outcore"}}]
    for tid, name in TRACKS.items():
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name",
                       "args": {"name": name}})
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index",
                       "args": {"sort_index": tid}})
    for tid, name, cat, a, b, args in SPANS:
        events.append({"ph": "X", "pid": PID, "tid": tid, "name": name, "cat": cat,
                       "ts": round(a * 1e6 + 1000, 3), "dur": round((b - a) * 1e6, 3),
                       "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {}}


class TraceSvg(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="trace_svg_test_")
        self.trace = os.path.join(self.dir.name, "trace.json")
        with open(self.trace, "w") as f:
            json.dump(trace_json(), f)

    def tearDown(self):
        self.dir.cleanup()

    def run_script(self, *args, trace=None):
        return subprocess.run([sys.executable, SCRIPT, trace or self.trace, *args],
                              capture_output=True, text=True, timeout=60)

    def render(self, *args):
        r = self.run_script(*args)
        self.assertEqual(r.returncode, 0, r.stderr)
        root = ET.fromstring(r.stdout)
        self.assertEqual(root.tag, SVG + "svg")
        rows = root.findall(f"{SVG}g[@class='track']")
        return rows, [row.get("data-track") for row in rows]

    def spans(self, row):
        return row.findall(f"{SVG}rect[@class='span']")

    def test_last_step_by_default_one_row_per_track_one_rect_per_span(self):
        rows, labels = self.render()
        # tid 4 has no span in step 2; the two zero-step threads are told apart by tid; the
        # lanes of the aio pool stay together.
        self.assertEqual(labels, ["trainer", "aio #0", "aio #1", "zero-step (tid 5)",
                                  "zero-step (tid 6)"])
        self.assertEqual([len(self.spans(r)) for r in rows], [4, 2, 1, 1, 1])
        rects = {r.find(f"{SVG}title").text.split(" ")[1]: r for r in self.spans(rows[0])}
        self.assertEqual(set(rects), {"step", "forward", "param", "backward"})
        y = {k: float(v.get("y")) for k, v in rects.items()}
        self.assertLess(y["step"], y["forward"])
        self.assertLess(y["forward"], y["param"])  # nested in forward: one level lower
        self.assertEqual(y["forward"], y["backward"])
        self.assertEqual(self.render("--step", "2")[1], labels)

    def test_span_crossing_the_window_edge_is_cut(self):
        rows, _ = self.render("--step", "2")
        read = next(r for r in self.spans(rows[1]) if "read" in r.find(f"{SVG}title").text)
        step = next(r for r in self.spans(rows[0]) if "step" in r.find(f"{SVG}title").text)
        self.assertEqual(read.get("x"), step.get("x"))  # starts at the window's start
        self.assertIn("a<b>.bin", read.find(f"{SVG}title").text)  # escaped, parsed back

    def test_window_and_all(self):
        rows, labels = self.render("--window", "0:0.5")
        self.assertEqual(labels, ["trainer", "thread 4"])
        self.assertEqual([len(self.spans(r)) for r in rows], [2, 1])
        rows, labels = self.render("--all")
        self.assertEqual(len(labels), len({s[0] for s in SPANS}))
        self.assertEqual(sum(len(self.spans(r)) for r in rows), len(SPANS))

    def test_writes_the_output_file(self):
        out = os.path.join(self.dir.name, "step.svg")
        r = self.run_script("--step", "1", "-o", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "")
        root = ET.parse(out).getroot()
        self.assertEqual(len(root.findall(f"{SVG}g[@class='track']")), 3)

    def test_bad_input_exits_non_zero_with_one_line(self):
        bad = os.path.join(self.dir.name, "bad.json")
        with open(bad, "w") as f:
            f.write('{"traceEvents": [')
        for args, trace, code in [(["--step", "7"], None, 1), ([], bad, 1),
                                  ([], os.path.join(self.dir.name, "missing.json"), 1),
                                  (["--window", "2:1"], None, 2)]:
            r = self.run_script(*args, trace=trace)
            self.assertEqual(r.returncode, code, (args, trace, r.stderr))
            self.assertEqual(r.stdout, "")
            if code == 1:
                self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
                self.assertTrue(r.stderr.startswith("trace_svg: "), r.stderr)

    def test_malformed_events_exit_one_with_one_line(self):
        bad_events = [
            {"ph": "X", "pid": [1], "tid": 1, "ts": 0, "dur": 1},
            {"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": 1,
             "args": {"sort_index": "x"}},
            {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": float("inf")},
        ]
        for i, event in enumerate(bad_events):
            doc = trace_json()
            doc["traceEvents"].append(event)
            path = os.path.join(self.dir.name, f"bad{i}.json")
            with open(path, "w") as f:
                json.dump(doc, f)
            r = self.run_script("--all", trace=path)
            self.assertEqual(r.returncode, 1, (event, r.stderr))
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
            self.assertTrue(r.stderr.startswith("trace_svg: "), r.stderr)
        # A thread name's args that are no object: the track goes unnamed, the rest is drawn.
        doc = trace_json()
        doc["traceEvents"].append({"ph": "M", "name": "thread_name", "pid": 1, "tid": 1,
                                   "args": [1]})
        path = os.path.join(self.dir.name, "unnamed.json")
        with open(path, "w") as f:
            json.dump(doc, f)
        self.assertEqual(self.run_script("--all", trace=path).returncode, 0)
        deep = os.path.join(self.dir.name, "deep.json")
        with open(deep, "w") as f:
            f.write("[" * 100000 + "]" * 100000)
        r = self.run_script(trace=deep)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        for args in (["--width", "99999999999"], ["--window", "0:inf"]):
            self.assertEqual(self.run_script(*args).returncode, 2, args)

    def test_the_trace_and_an_earlier_output_are_never_lost(self):
        with open(self.trace) as f:
            before = f.read()
        r = self.run_script("--all", "-o", self.trace)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("is the trace itself", r.stderr)
        with open(self.trace) as f:
            self.assertEqual(f.read(), before)
        # An output that cannot be made (its name is taken by a directory): the old file stays.
        out = os.path.join(self.dir.name, "step.svg")
        with open(out, "w") as f:
            f.write("earlier")
        os.mkdir(f"{out}.tmp-0")  # not this process's name: the write goes through
        r = self.run_script("--all", "-o", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        os.chmod(self.dir.name, 0o500)  # no temporary can be made beside it now
        try:
            r = self.run_script("--all", "-o", out)
            if os.geteuid() != 0:
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertIn(out, r.stderr)
        finally:
            os.chmod(self.dir.name, 0o700)
        ET.parse(out)  # whole, either way
        self.assertEqual([n for n in os.listdir(self.dir.name) if ".tmp-" in n and
                          not n.endswith(".tmp-0")], [])


if __name__ == "__main__":
    unittest.main()
