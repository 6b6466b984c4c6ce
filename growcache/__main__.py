"""``python -m growcache``: the ``growcache`` command (see :mod:`growcache.cli`).

Useful where the console script is not on ``PATH`` (a venv that is not activated, a
``pip install --user`` without ``~/.local/bin``), and to pick the interpreter explicitly.
"""

import sys

from growcache.cli import main

# Guarded: sampler processes started with ``spawn`` may import this module as their main.
if __name__ == "__main__":
    sys.exit(main())
