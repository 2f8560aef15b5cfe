import sys

from minfer.cli import main

sys.exit(main())
