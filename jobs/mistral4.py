"""Job entrypoint: `ray job submit --working-dir . -- python jobs/mistral4.py --config X [--override k=v]...`.

The same as `rayft train`; without --config it runs the built-in tiny demo on a local Ray cluster.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the job's working dir holds rayft/

from rayft.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
