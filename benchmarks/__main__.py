"""`python -m benchmarks`: see benchmarks/run.py; `--zoo` and `--tf1-models`:
benchmarks/zoo.py."""
import sys

for flag, suite in (("--zoo", "zoo"), ("--tf1-models", "tf1_models")):
    if flag in sys.argv[1:]:
        from benchmarks.zoo import main
        sys.exit(main([a for a in sys.argv[1:] if a != flag], suite))

from benchmarks.run import main  # noqa: E402

sys.exit(main())
