"""Fine-tune a pretraining checkpoint on one GLUE task, as the paper's ``run_glue.py`` did.

    python code/run_glue.py --task SST-2 --checkpoint 3 --lr 2e-5 --batch_size 32 --epoch 5 [--model-dir DIR]

Works from the repository root or from inside a model folder (``--model-dir`` defaults to ``.``); the
same as ``nystromformer glue``. See docs/glue.md.
"""
import sys
from pathlib import Path

CODE_DIR = str(Path(__file__).resolve().parent)
if CODE_DIR not in sys.path:  # run as a script, without the package installed
    sys.path.insert(0, CODE_DIR)

from nystromformer.glue.commands import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
