import sys

from rooflm.cli import main

sys.exit(main())
