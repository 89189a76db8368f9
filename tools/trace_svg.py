#!/usr/bin/python3
"""Renders a Chrome trace-event JSON file (outcore train|demo --trace FILE) as an SVG timeline.

One row per track (pid/tid, named by its thread_name metadata event) that has a span in the
window; spans ("ph": "X" complete events) are rectangles, stacked by nesting depth within their
row, coloured by category (one hue each) and name (shades of it), with the name written where
it fits and the details in a tooltip. Below the rows: a time axis (seconds or milliseconds from
the window's start) and a legend of every category/name drawn.

Window: one training step (--step N: the span named "step" with args.index N; by default the
last such span), a range of the trace (--window START:END, seconds since its first event), or
all of it (--all). Spans crossing the window's edges are cut at them.

    /usr/bin/python3 tools/trace_svg.py trace.json -o step.svg [--step N | --window A:B | --all]

The SVG is written whole under a temporary name beside the output and renamed over it (a
failed write keeps the previous file); an output that is the trace itself is refused.

Standard library only. Exit status 0 on success, 1 with one line on stderr when the trace
cannot be read (or is malformed) or the window holds nothing or the output cannot be written,
2 for bad arguments.
"""
import argparse
import colorsys
import json
import math
import os
import re
import sys
from xml.sax.saxutils import escape, quoteattr

LANE_H = 14  # pixels per nesting level in a row
ROW_GAP = 4
LABEL_W = 150  # track names
MARGIN = 10
AXIS_H = 30
LEGEND_ROW_H = 16
MAX_WIDTH = 100000  # pixels: a wider picture is no picture, and its ticks would fill memory


class TraceError(Exception):
    pass


def load(path):
    """Returns (spans, track names, track sort keys) of the trace at `path`."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: {e}") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise TraceError(f"{path}: no traceEvents array")
    names, order, spans = {}, {}, []

    def bad(e, what):
        return TraceError(f"{path}: {what}: {json.dumps(e)[:200]}")

    for e in events:
        if not isinstance(e, dict):
            continue
        key = (e.get("pid", 0), e.get("tid", 0))
        if not all(isinstance(k, (int, str)) and not isinstance(k, bool) for k in key):
            raise bad(e, "an event whose pid or tid is not a number or a string")
        key = tuple(str(k) if isinstance(k, str) else k for k in key)
        args = e.get("args")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[key] = str(args.get("name", "") if isinstance(args, dict) else "")
        elif e.get("ph") == "M" and e.get("name") == "thread_sort_index":
            index = args.get("sort_index", 0) if isinstance(args, dict) else 0
            if not isinstance(index, (int, float)) or isinstance(index, bool) or \
                    not math.isfinite(index):
                raise bad(e, "a thread_sort_index that is not a finite number")
            order[key] = index
        elif e.get("ph") == "X":
            try:
                ts, dur = float(e["ts"]) / 1e6, float(e.get("dur", 0)) / 1e6
            except (KeyError, TypeError, ValueError):
                raise bad(e, "a complete event without numeric ts and dur") from None
            if not (math.isfinite(ts) and math.isfinite(dur)):
                raise bad(e, "a complete event whose ts or dur is not finite")
            args = e.get("args")
            spans.append({"track": key, "name": str(e.get("name", "")),
                          "cat": str(e.get("cat", "")), "start": ts, "end": ts + max(dur, 0.0),
                          "args": args if isinstance(args, dict) else {}})
    if not spans:
        raise TraceError(f"{path}: no complete (\"ph\": \"X\") events")
    return spans, names, order


def choose_window(spans, args):
    """(start, end, title) in seconds of the trace's clock."""
    t0 = min(s["start"] for s in spans)
    if args.all:
        return t0, max(s["end"] for s in spans), "whole trace"
    if args.window:
        return t0 + args.window[0], t0 + args.window[1], (
            f"{args.window[0]:g} s to {args.window[1]:g} s of the trace")
    steps = [s for s in spans if s["name"] == "step" and s["cat"] == "step"]
    if args.step is not None:
        steps = [s for s in steps if s["args"].get("index") == args.step]
        if not steps:
            raise TraceError(f"no span \"step\" with index {args.step} in the trace")
    elif not steps:
        return t0, max(s["end"] for s in spans), "whole trace (no step spans)"
    step = max(steps, key=lambda s: s["end"])
    index = step["args"].get("index")
    return step["start"], step["end"], f"step {index}" if index is not None else "last step"


def overlaps(s, start, end):
    """Whether span `s` has time in [start, end) (an instant: lies in it)."""
    if s["start"] == s["end"]:
        return start <= s["start"] < end
    return s["start"] < end and s["end"] > start


def clip(spans, start, end):
    """The spans in [start, end), cut at its edges."""
    out = []
    for s in (s for s in spans if overlaps(s, start, end)):
        c = dict(s)
        c["start"], c["end"] = max(s["start"], start), min(s["end"], end)
        out.append(c)
    return out


def assign_depths(spans):
    """Sets each span's nesting depth on its track; returns {track: number of levels}."""
    levels = {}
    by_track = {}
    for s in spans:
        by_track.setdefault(s["track"], []).append(s)
    for track, items in by_track.items():
        items.sort(key=lambda s: (s["start"], -(s["end"] - s["start"])))
        open_ends = []  # end times of the enclosing spans
        for s in items:
            while open_ends and open_ends[-1] <= s["start"]:
                open_ends.pop()
            s["depth"] = len(open_ends)
            open_ends.append(s["end"])
        levels[track] = 1 + max(s["depth"] for s in items)
    return levels


# Hues of outcore's span categories (common/trace.hpp's callers); waits are grey. Other
# categories get hues spread between these.
CATEGORY_HUES = {"compute": 0.60, "io": 0.97, "copy": 0.78, "optimizer": 0.08, "step": 0.30,
                 "wait": None}


def palette(spans):
    """{(cat, name): colour}: a hue per category (grey for waits), lightness steps per name."""
    cats = sorted({s["cat"] for s in spans})
    others = [c for c in cats if c not in CATEGORY_HUES]
    colours = {}
    for cat in cats:
        if cat in CATEGORY_HUES:
            hue = CATEGORY_HUES[cat]
        else:
            hue = (0.15 + 0.9 * (others.index(cat) + 0.5) / len(others)) % 1.0
        names = sorted({s["name"] for s in spans if s["cat"] == cat})
        for j, name in enumerate(names):
            light = 0.40 + 0.35 * j / (len(names) - 1) if len(names) > 1 else 0.55
            r, g, b = colorsys.hls_to_rgb(hue or 0.0, light, 0.0 if hue is None else 0.65)
            colours[(cat, name)] = "#" + "".join(f"{round(v * 255):02x}" for v in (r, g, b))
    return colours


def lane_of(name):
    """("pool", 2) for a lane "pool #2", else (name, -1)."""
    m = re.fullmatch(r"(.*) #(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, -1)


def order_tracks(tracks, names, order):
    """The trace's order (thread_sort_index, else tid), with the lanes of a pool kept together
    (ordered by lane number) where the pool's first lane stands."""
    rank = {t: (t[0], order.get(t, t[1]), t[1]) for t in tracks}
    first = {}
    for t in tracks:
        pool = (t[0], lane_of(names.get(t, ""))[0]) if names.get(t) else t
        first[pool] = min(first.get(pool, rank[t]), rank[t])
    def key(t):
        name = names.get(t)
        pool = (t[0], lane_of(name)[0]) if name else t
        return (first[pool], lane_of(name)[1] if name else -1, rank[t])
    return sorted(tracks, key=key)


def track_labels(tracks, names):
    """Thread names; "thread <tid>" for unnamed ones; a name shared by several tracks (a
    thread started anew for each step) gets its tid appended."""
    labels = {t: names.get(t) or f"thread {t[1]}" for t in tracks}
    count = {}
    for label in labels.values():
        count[label] = count.get(label, 0) + 1
    return {t: f"{l} (tid {t[1]})" if count[l] > 1 else l for t, l in labels.items()}


def tick_step(span_s, width_px):
    """A 1/2/5 x 10^k seconds tick interval giving ticks about 80 px apart."""
    raw = span_s * 80 / max(width_px, 1)
    k = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 5, 10):
        if m * k >= raw:
            return m * k
    return 10 * k


def tooltip(s):
    dur = s["end"] - s["start"]
    extra = ", ".join(f"{k} {v}" for k, v in sorted(s["args"].items()))
    return f"{s['cat']}: {s['name']} {dur * 1e3:.3f} ms" + (f" ({extra})" if extra else "")


class Canvas:
    """Maps trace time to x, and collects SVG elements from the top down."""

    def __init__(self, start, end, width):
        self.start, self.end, self.width = start, end, width
        self.scale = (width - LABEL_W - 2 * MARGIN) / max(end - start, 1e-9)
        self.y = MARGIN + 20  # below the title
        self.out = []

    def x(self, t):
        return MARGIN + LABEL_W + (t - self.start) * self.scale


def draw_track(c, label, spans, levels, colours):
    """One row: the label, then each span at its nesting depth."""
    h = levels * LANE_H
    c.out.append(f'<g class="track" data-track={quoteattr(label)}>')
    c.out.append(f'<text class="label" x="{MARGIN}" y="{c.y + LANE_H - 3}">{escape(label)}</text>')
    line_y = c.y + h + ROW_GAP / 2
    c.out.append(f'<line class="row" x1="{MARGIN + LABEL_W}" x2="{c.width - MARGIN}" '
                 f'y1="{line_y:.1f}" y2="{line_y:.1f}"/>')
    for s in spans:
        x, w = c.x(s["start"]), max((s["end"] - s["start"]) * c.scale, 0.5)
        y = c.y + s["depth"] * LANE_H
        c.out.append(f'<rect class="span" x="{x:.1f}" y="{y}" width="{w:.1f}" '
                     f'height="{LANE_H - 1}" fill="{colours[(s["cat"], s["name"])]}">'
                     f'<title>{escape(tooltip(s))}</title></rect>')
        if w > 7 * len(s["name"]) + 4:
            c.out.append(f'<text class="name" x="{x + 2:.1f}" y="{y + LANE_H - 4}">'
                         f'{escape(s["name"])}</text>')
    c.out.append("</g>")
    c.y += h + ROW_GAP


def draw_axis(c):
    """Ticks in milliseconds (windows under 2 s) or seconds from the window's start."""
    span_s = c.end - c.start
    step = tick_step(span_s, c.width - LABEL_W - 2 * MARGIN)
    unit, mul = ("ms", 1e3) if span_s < 2 else ("s", 1.0)
    c.out.append('<g class="axis">')
    c.out.append(f'<line x1="{MARGIN + LABEL_W}" x2="{c.width - MARGIN}" y1="{c.y}" y2="{c.y}"/>')
    for i in range(int(span_s / step) + 1):
        x = c.x(c.start + i * step)
        c.out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{c.y}" y2="{c.y + 5}"/>')
        c.out.append(f'<text x="{x:.1f}" y="{c.y + 17}" text-anchor="middle">'
                     f'{i * step * mul:g}</text>')
    c.out.append(f'<text x="{MARGIN}" y="{c.y + 17}">{unit} from start</text>')
    c.out.append("</g>")
    c.y += AXIS_H


def draw_legend(c, colours):
    """A swatch per category/name, wrapped to the width."""
    c.out.append('<g class="legend">')
    x = MARGIN
    for (cat, name), colour in sorted(colours.items()):
        text = f"{cat}: {name}"
        w = 30 + 6.5 * len(text)
        if x + w > c.width - MARGIN and x > MARGIN:
            x, c.y = MARGIN, c.y + LEGEND_ROW_H
        c.out.append(f'<rect class="swatch" x="{x}" y="{c.y}" width="10" height="10" '
                     f'fill="{colour}"/>')
        c.out.append(f'<text x="{x + 14}" y="{c.y + 9}">{escape(text)}</text>')
        x += w
    c.out.append("</g>")
    c.y += LEGEND_ROW_H


def render(spans, names, order, start, end, title, width):
    """The SVG document of the spans in [start, end)."""
    spans = clip(spans, start, end)
    if not spans:
        raise TraceError("the window holds no span")
    levels = assign_depths(spans)
    tracks = order_tracks(levels, names, order)
    labels = track_labels(tracks, names)
    colours = palette(spans)
    by_track = {t: [] for t in tracks}
    for s in spans:
        by_track[s["track"]].append(s)
    c = Canvas(start, end, width)
    for t in tracks:
        draw_track(c, labels[t], by_track[t], levels[t], colours)
    draw_axis(c)
    draw_legend(c, colours)
    height = round(c.y + MARGIN)
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">\n'
            '<style>.row{stroke:#ddd} .axis line{stroke:#333} .span{stroke:none} '
            '.name{font-size:9px;fill:#fff;pointer-events:none}</style>\n'
            '<rect width="100%" height="100%" fill="#fff"/>\n'
            f'<text x="{MARGIN}" y="{MARGIN + 10}" font-weight="bold">{escape(title)}: '
            f'{(end - start) * 1e3:.1f} ms, {len(spans)} spans on {len(tracks)} tracks</text>\n')
    return head + "\n".join(c.out) + "\n</svg>\n"


def parse_window(text):
    try:
        a, b = (float(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END in seconds, got {text!r}") from None
    if not (math.isfinite(a) and math.isfinite(b) and b - a < 1e9):
        raise argparse.ArgumentTypeError(f"need finite seconds less than 1e9 apart, got {text!r}")
    if not (0 <= a < b):
        raise argparse.ArgumentTypeError(f"need 0 <= START < END, got {text!r}")
    return a, b


def main(argv=None):
    p = argparse.ArgumentParser(description="Chrome trace-event JSON -> SVG timeline")
    p.add_argument("trace", help="trace file (outcore train|demo --trace FILE)")
    p.add_argument("-o", "--output", help="SVG file to write (default: stdout)")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--step", type=int, help="the window of step N (default: the last step)")
    w.add_argument("--window", type=parse_window, metavar="START:END",
                   help="seconds since the trace's first event")
    w.add_argument("--all", action="store_true", help="the whole trace")
    p.add_argument("--width", type=int, default=1200, help="pixels (default 1200)")
    args = p.parse_args(argv)
    if not LABEL_W + 2 * MARGIN + 100 <= args.width <= MAX_WIDTH:
        p.error(f"--width: from {LABEL_W + 2 * MARGIN + 100} to {MAX_WIDTH}")
    try:
        if args.output and os.path.exists(args.output) and os.path.exists(args.trace) and \
                os.path.samefile(args.output, args.trace):
            raise TraceError(f"{args.output}: is the trace itself; write the SVG elsewhere")
        spans, names, order = load(args.trace)
        start, end, title = choose_window(spans, args)
        svg = render(spans, names, order, start, end, title, args.width)
        if args.output:
            write_whole(args.output, svg)
        else:
            sys.stdout.write(svg)
            sys.stdout.flush()
    except (TraceError, OSError) as e:
        print(f"trace_svg: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, AttributeError, KeyError, OverflowError, RecursionError) as e:
        print(f"trace_svg: {args.trace}: not a trace this can draw ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 1
    return 0


def write_whole(path, text):
    """`text` as the file `path` names (through a link, the file it names): written under a
    temporary name of its own beside it (never a file already there), then renamed over it, so
    a failed write leaves the old file and no temporary."""
    target = os.path.realpath(path)
    for k in range(100):
        tmp = f"{target}.tmp-{os.getpid()}" + (f"-{k}" if k else "")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    else:
        raise OSError(17, f"cannot write {path}: its temporary names are all taken")
    done = False
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        done = True
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    finally:
        if not done:
            try:
                os.unlink(tmp)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
