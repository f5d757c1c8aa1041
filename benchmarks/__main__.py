"""`python -m benchmarks`: see benchmarks/run.py; `--zoo`: benchmarks/zoo.py."""
import sys

if "--zoo" in sys.argv[1:]:
    from benchmarks.zoo import main
    sys.exit(main([a for a in sys.argv[1:] if a != "--zoo"]))

from benchmarks.run import main  # noqa: E402

sys.exit(main())
