"""`python -m pipeline.report` (and `make report`): runs the command line of cli.py."""

import sys

from pipeline.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
