#!/usr/bin/env bash
# Opens a memfit HTML report in headless Chromium and checks the rendered DOM.
#
#   check_report.sh REPORT.html EXPECTED_PEAK_BYTES [SCREENSHOT.png]
#
# Checks: #timeline-chart exists and has path/polygon shapes, a .legend-item
# with data-category and its label for each of the five categories, and
# #peak-value's data-bytes equals EXPECTED_PEAK_BYTES. Exits 0 when all pass.
# Needs chromium (Debian package "chromium") and python3 (standard library only).
set -u

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: $0 REPORT.html EXPECTED_PEAK_BYTES [SCREENSHOT.png]" >&2
  exit 2
fi
report=$1
expected_peak=$2
screenshot=${3:-}

if [ ! -f "$report" ]; then
  echo "browser report check: report file not found: $report"
  exit 1
fi
chromium_bin=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$chromium_bin" ]; then
  echo "browser report check: chromium is not installed (apt-get install chromium)"
  exit 1
fi
if ! command -v python3 >/dev/null; then
  echo "browser report check: python3 is not installed (needed to parse the DOM)"
  exit 1
fi

report_url="file://$(cd "$(dirname "$report")" && pwd)/$(basename "$report")"
profile_dir=$(mktemp -d)
dom_file=$(mktemp)
trap 'rm -rf "$profile_dir" "$dom_file"' EXIT

# A fresh profile and no background services: the run must not touch the network.
chromium_flags=(--headless --no-sandbox --disable-gpu --disable-background-networking --no-first-run
                --disable-component-update --disable-sync "--user-data-dir=$profile_dir")

# The virtual-time budget lets the inline script run before the DOM is dumped.
if ! timeout 120 "$chromium_bin" "${chromium_flags[@]}" --virtual-time-budget=2000 --dump-dom "$report_url" \
     >"$dom_file" 2>/dev/null || [ ! -s "$dom_file" ]; then
  echo "browser report check: chromium failed to render $report"
  exit 1
fi

failed=0
if [ -n "$screenshot" ]; then
  rm -f "$screenshot"
  timeout 120 "$chromium_bin" "${chromium_flags[@]}" --hide-scrollbars --window-size=1400,1800 \
    "--screenshot=$(realpath -m "$screenshot")" "$report_url" >/dev/null 2>&1
  if [ ! -s "$screenshot" ]; then
    echo "FAILED: screenshot was not written to $screenshot"
    failed=1
  fi
fi

# Parse the dumped DOM; prints one "PASS ..." or "FAIL ..." line per check.
results=$(python3 - "$dom_file" "$expected_peak" <<'PY'
import sys
from html.parser import HTMLParser

dom_path, expected_peak = sys.argv[1], sys.argv[2]
labels = {"weights": "Weights", "gradients": "Gradients", "optimizer_state": "Optimizer state",
          "activations": "Activations", "other": "Other"}

class Dom(HTMLParser):
    """Collects what the checks need: shapes inside #timeline-chart, legend texts, #peak-value."""
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
    def __init__(self):
        super().__init__()
        self.stack = []            # open elements: (tag, attrs)
        self.timeline_found = False
        self.timeline_shapes = 0
        self.legend = {}           # data-category -> visible text
        self.peak_bytes = None
        self.peak_text = ""
    def inside(self, predicate):
        return next((attrs for _, attrs in reversed(self.stack) if predicate(attrs)), None)
    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id") == "timeline-chart":
            self.timeline_found = True
        if tag in ("path", "polygon") and self.inside(lambda a: a.get("id") == "timeline-chart") is not None:
            self.timeline_shapes += 1
        if "legend-item" in attrs.get("class", "").split():
            self.legend.setdefault(attrs.get("data-category", ""), "")
        if attrs.get("id") == "peak-value":
            self.peak_bytes = attrs.get("data-bytes")
        if tag not in self.VOID and not self.get_starttag_text().endswith("/>"):
            self.stack.append((tag, attrs))
    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break
    def handle_data(self, data):
        item = self.inside(lambda a: "legend-item" in a.get("class", "").split())
        if item is not None:
            self.legend[item.get("data-category", "")] += data
        if self.inside(lambda a: a.get("id") == "peak-value") is not None:
            self.peak_text += data

dom = Dom()
dom.feed(open(dom_path, encoding="utf-8", errors="replace").read())

def check(ok, name, detail=""):
    print(("PASS " if ok else "FAIL ") + name + ("" if ok or not detail else ": " + detail))

check(dom.timeline_found, "#timeline-chart exists")
check(dom.timeline_shapes > 0, "#timeline-chart contains path/polygon elements",
      f"found {dom.timeline_shapes}")
for key, label in labels.items():
    text = " ".join(dom.legend.get(key, "").split())
    check(key in dom.legend and text == label, f"legend-item '{key}' labelled '{label}'",
          "missing" if key not in dom.legend else f"text is '{text}'")
check(dom.peak_bytes == expected_peak, f"#peak-value data-bytes == {expected_peak}", f"got {dom.peak_bytes}")
check(expected_peak in dom.peak_text, "#peak-value text shows the exact bytes", f"text is '{dom.peak_text.strip()}'")
PY
)
if [ -z "$results" ]; then
  echo "browser report check: could not parse the rendered DOM"
  exit 1
fi

passed=$(grep -c '^PASS ' <<<"$results")
failures=$(grep -c '^FAIL ' <<<"$results")
grep '^FAIL ' <<<"$results" | sed 's/^FAIL /FAILED: /'
failures=$((failures + failed))
echo "browser report check: $passed passed, $failures failed"
[ "$failures" -eq 0 ]
