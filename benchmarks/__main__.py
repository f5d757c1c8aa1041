"""`python -m benchmarks`: see benchmarks/run.py; `--zoo`: benchmarks/zoo.py;
`--tf1-models`: benchmarks/tf1_bench.py."""
import sys

if "--zoo" in sys.argv[1:]:
    from benchmarks.zoo import main
    sys.exit(main([a for a in sys.argv[1:] if a != "--zoo"]))

if "--tf1-models" in sys.argv[1:]:
    from benchmarks.tf1_bench import main
    sys.exit(main([a for a in sys.argv[1:] if a != "--tf1-models"]))

from benchmarks.run import main  # noqa: E402

sys.exit(main())
