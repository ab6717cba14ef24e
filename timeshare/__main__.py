import sys

from timeshare.cli import main

sys.exit(main())
