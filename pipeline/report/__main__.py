"""`python -m pipeline.report` (and `make report`): runs the command line of cli.py."""

import gc
import sys

from pipeline.report.cli import main

if __name__ == "__main__":
    code = main()
    gc.freeze()  # all written: the interpreter ends without collecting the whole heap (a second here)
    sys.exit(code)
