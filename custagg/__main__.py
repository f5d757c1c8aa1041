"""`python -m custagg`: the main job (see `custagg.app.cli`).

Nothing here imports TensorFlow: `custagg.app.cli.main` parses the flags and
sets TensorFlow's log level first, so `--help` and flag errors answer at once.
"""

import sys

from custagg.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
