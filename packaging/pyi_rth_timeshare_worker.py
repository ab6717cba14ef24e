"""PyInstaller runtime hook: let the frozen executable run ``-m MODULE`` like a Python interpreter.

The pool starts each model's worker as ``sys.executable -m timeshare.core.worker ...``; in a frozen
build ``sys.executable`` is the Timeshare executable itself, so that command line arrives here
before the CLI would parse (and reject) it. Only Timeshare's own modules may be run this way.
"""

import runpy
import sys

if len(sys.argv) >= 3 and sys.argv[1] == "-m" and sys.argv[2].startswith("timeshare."):
    module = sys.argv[2]
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    sys.exit(code)
