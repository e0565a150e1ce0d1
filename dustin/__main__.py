"""`python -m dustin ...` (also what torchrun launches)."""
import sys

from dustin.cli.main import main

sys.exit(main())
