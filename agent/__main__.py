"""`python -m gpuscope` is the same as the `gpuscope` console script."""

import sys

from gpuscope.cli.main import main

sys.exit(main())
