"""`python -m keras_layoutmap ...`: the command line (`keras_layoutmap.cli`).

It imports the CLI module only; the CLI imports Keras after parsing its
arguments, so `--help` needs no backend (as far as the package's own import
allows: see `keras_layoutmap/cli.py`).
"""

import sys

from keras_layoutmap.cli import main

if __name__ == "__main__":
    sys.exit(main())
