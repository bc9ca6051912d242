#!/usr/bin/env python3
"""Validates a /metrics scrape with real parsers (issue 21, "How it is checked").

usage: check_exposition.py {text|openmetrics} FILE

* text (Prometheus text format 0.0.4): `promtool check metrics` (Debian's `prometheus`
  package; it parses 0.0.4 and lints: HELP on every family, counter names, units), then
  prometheus_client's 0.0.4 parser;
* openmetrics (OpenMetrics text 1.0.0): prometheus_client's strict OpenMetrics parser
  (`prometheus_client.openmetrics.parser`), which also requires the final `# EOF`.

Exit 0 when the scrape is valid, 1 with the parser's words when it is not, 77 (skip) when a
tool is missing and ENGY_REQUIRE_PROMTOOL is not 1 (.ci/run sets it and installs the tools).
"""
import os
import shutil
import subprocess
import sys


def missing(what):
    if os.environ.get("ENGY_REQUIRE_PROMTOOL") == "1":
        print(f"{what} is not installed (ENGY_REQUIRE_PROMTOOL=1)", file=sys.stderr)
        sys.exit(1)
    print(f"SKIP: {what} is not installed", file=sys.stderr)
    sys.exit(77)


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("text", "openmetrics"):
        print(__doc__, file=sys.stderr)
        return 2
    fmt, path = sys.argv[1], sys.argv[2]
    text = open(path, encoding="utf-8").read()
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        missing("python3 prometheus_client (pip install prometheus-client)")
    if fmt == "text":
        promtool = shutil.which("promtool")
        if promtool is None:
            missing("promtool (apt-get install prometheus)")
        r = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                           capture_output=True)
        if r.returncode != 0:
            print(f"promtool check metrics exit {r.returncode}: "
                  f"{(r.stdout + r.stderr).decode(errors='replace').strip()}", file=sys.stderr)
            return 1
        from prometheus_client.parser import text_string_to_metric_families
        parse = text_string_to_metric_families
    else:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
        parse = text_string_to_metric_families
    try:
        families = list(parse(text))
    except Exception as e:  # the parser's own words
        print(f"{fmt} parse error: {e}", file=sys.stderr)
        return 1
    samples = sum(len(f.samples) for f in families)
    print(f"ok: {len(families)} families, {samples} samples ({fmt})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
