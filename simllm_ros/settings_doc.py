"""The parameter table of docs/settings.md, written from the Settings fields so that it cannot fall behind them.

    python -m simllm_ros.settings_doc    # rewrites the table between the markers (test_settings checks it)
"""
import json
import os
import sys

from .settings import SPECS, ParamSpec

BEGIN = "<!-- BEGIN parameter table: generated from simllm_ros/settings.py by python -m simllm_ros.settings_doc -->"
END = "<!-- END parameter table -->"
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "settings.md")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "\\<")  # a bare <name> reads as an HTML tag


def _bounds(spec: ParamSpec) -> str:
    if spec.choices is not None:
        return ", ".join(f"`{json.dumps(c)}`" for c in spec.choices)
    if spec.min is not None or spec.max is not None:
        return f"[{spec.min}, {spec.max}]"
    return ""


def table() -> str:
    """The markdown table, one row per field, in field order, between the markers."""
    rows = [BEGIN, "| name | type | default | range or choices | changes | meaning |",
            "|---|---|---|---|---|---|"]
    for s in SPECS:
        default = f"`{_cell(json.dumps(s.default, ensure_ascii=False))}`"
        live = "live" if s.live else "reconfigure"
        rows.append(f"| `{s.name}` | {s.type.__name__} | {default} | {_bounds(s)} | {live} | {_cell(s.description)} |")
    rows.append(END)
    return "\n".join(rows)


def table_in(text: str) -> str:
    """The table as it stands in the document's text, markers included; ValueError if a marker is missing."""
    start, end = text.index(BEGIN), text.index(END)
    return text[start:end + len(END)]


def main() -> int:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    new = text.replace(table_in(text), table())
    if new != text:
        tmp = DOC + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(new)
        os.replace(tmp, DOC)
    print(f"{DOC}: {'rewritten' if new != text else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
