import sys

from .sdpa import main

sys.exit(main())
