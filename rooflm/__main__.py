import sys

from rooflm.cli import main

# Guarded: a process spawned by multiprocessing may import this module again.
if __name__ == "__main__":
    sys.exit(main())
