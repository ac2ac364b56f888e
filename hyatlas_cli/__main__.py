"""python -m hyatlas_cli: the same as the `hyatlas` command."""

import sys

from hyatlas_cli.main import main

sys.exit(main())
