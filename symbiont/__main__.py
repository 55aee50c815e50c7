import sys

from symbiont.cli import main

sys.exit(main())
