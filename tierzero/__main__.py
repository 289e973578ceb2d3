"""`python -m tierzero ...` runs the `tierzero` command line."""

import sys

from tierzero.engine.cli import main

sys.exit(main())
