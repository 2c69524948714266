"""`python -m steadyrl.cli ...`: the same as the `steadyrl` console script."""

import sys

from steadyrl.cli import main

sys.exit(main())
