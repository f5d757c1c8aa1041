"""`python -m benchmarks`: the harness, benchmarks/run.py."""
import sys

from benchmarks.run import main

sys.exit(main())
