"""`python -m moelane ...`: the `moelane` command (as torchrun starts it: `torchrun -m moelane ...`)."""

import sys

from moelane.commands import main

sys.exit(main())
