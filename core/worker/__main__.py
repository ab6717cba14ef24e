"""``python -m timeshare.core.worker``: the worker process (see :mod:`.loop`)."""

import sys

from .loop import main

sys.exit(main())
