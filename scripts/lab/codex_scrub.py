"""Scrub a request body Codex CLI sent (logged by request_log_proxy.py) into test data.

    python scripts/lab/codex_scrub.py LAB_DIR/requests/002-request.json tests/data/codex/NAME.json \
        --lab LAB_DIR

Machine-specific things go: the lab directory's path becomes /home/user/project's parent, every
UUID (session, thread, turn, installation, item ids) becomes a fixed fake in order of appearance,
and ``model`` becomes "MODEL" (the test names its own). Texts longer than --keep characters
in ``input`` (Codex's base instructions: about 17,000 characters) are cut to their start with a note saying
so, which keeps a replay's prompt inside a demo model's context and its prefill short; every field,
item, tool and schema stays as Codex sent it.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def scrub(body: dict[str, Any], lab: str, keep: int) -> dict[str, Any]:
    fakes: dict[str, str] = {}

    def fake(match: re.Match[str]) -> str:
        return fakes.setdefault(match[0], f"00000000-0000-7000-8000-{len(fakes) + 1:012d}")

    def text(value: str, cut_long: bool) -> str:
        value = _UUID.sub(fake, value.replace(lab, "/home/user"))
        if cut_long and len(value) > keep:
            cut = len(value) - keep
            value = value[:keep] + f"\n[... {cut} more characters of Codex's text, cut for the test]"
        return value

    def walk(node: Any, cut_long: bool = False) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, cut_long) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, cut_long) for v in node]
        if isinstance(node, str):
            return text(node, cut_long)
        return node

    out: dict[str, Any] = {k: walk(v, cut_long=k == "input") for k, v in body.items()}
    out["model"] = "MODEL"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logged", type=Path, help="NNN-request.json from request_log_proxy.py")
    parser.add_argument("out", type=Path)
    parser.add_argument("--lab", required=True, help="the lab directory (its path is scrubbed)")
    parser.add_argument("--keep", type=int, default=1200, help="the longest text kept whole")
    args = parser.parse_args()
    body = json.loads(args.logged.read_text())["body"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scrubbed = scrub(body, args.lab.rstrip("/"), args.keep)
    args.out.write_text(json.dumps(scrubbed, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
