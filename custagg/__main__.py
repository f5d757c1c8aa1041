"""`python -m custagg`: the main job (see `custagg.cli`)."""

import sys

from custagg.cli import main

if __name__ == "__main__":
    sys.exit(main())
