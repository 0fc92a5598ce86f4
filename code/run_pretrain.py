"""Entry script kept from the paper's repo layout; same as `nystromformer pretrain`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from nystromformer.pretrain import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
