"""A model process for the hand-over residency tests (tests/test_handover_residency.py): a real
llama-cpp-python model (loaded as a CPU worker loads it: no mmap), its residency with the
hand-over on (the memfd stand-in plays the device: named as such), driven line by line.

    release | restore       the residency's; restore answers "ok <handed> <created> <moved> <mapped>"
                            (mapped: chunks mapped by it; 0 when its own kept mapping was used)
    check                   "ok" when 8 greedy steps give bitwise the logits of before attach
    logits PATH             "ok": the logits of 8 greedy steps saved to PATH (numpy .npy, for an
                            oracle of the test's own)
    steps                   the last restore's steps (JSON: uploaded / skipped bytes, chunks)
    stats                   the residency's hand-over figures (JSON)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llama_cpp  # noqa: F401  (before numpy)
import numpy as np
from _residency_util import Greedy, load, same
from timeshare.core.arena.handclient import HandoverClient
from timeshare.core.residency import Residency, ResidencyOptions


def main() -> None:
    arena, _tag, chunk, model = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    llm = load(model)
    greedy = Greedy(llm)
    reference = greedy.run()
    client = HandoverClient(arena, "model", chunk_bytes=chunk)
    client.connect()
    res = Residency.attach(llm, model, ResidencyOptions(handover=True), chunk_source=client)
    print(f"ready {res.path} {res.handover_note!r}", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "release":
            res.release()
            out = "ok"
        elif cmd == "restore":
            report = res.restore()
            steps = res.restore_steps
            handed, created = int(steps.handed_chunks or 0), int(steps.created_chunks or 0)
            out = f"ok {handed} {created} {report.addresses_moved} {int(steps.mapped_chunks or 0)}"
        elif cmd == "check":
            out = "ok" if same(reference, greedy.run()) else "different"
        elif cmd == "logits":
            np.save(arg, np.stack(greedy.run()))
            out = "ok"
        elif cmd == "steps":
            out = json.dumps(res.restore_steps.as_dict())
        elif cmd == "stats":
            out = json.dumps(res.handover)
        else:
            out = f"unknown {cmd}"
        print(out, flush=True)
    res.close()
    client.close()
    llm.close()


if __name__ == "__main__":
    main()
