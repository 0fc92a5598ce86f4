"""Entry script kept from the paper's repo layout; same as `nystromformer validate`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from nystromformer.validate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
