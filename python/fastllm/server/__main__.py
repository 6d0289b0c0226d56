"""``python -m fastllm.server [MODEL] ...``: the same as ``fastllm serve [MODEL] ...``."""

import sys

from fastllm.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
