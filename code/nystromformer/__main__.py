"""``python -m nystromformer …``: the same command as ``nystromformer …`` (e.g. from a checkout without the entry point)."""
import sys

from nystromformer.cli import main

sys.exit(main())
