"""python -m benchmarks <kind> [options]: the same as `pagellm bench <kind> [options]`."""
import sys

from pagellm.benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
