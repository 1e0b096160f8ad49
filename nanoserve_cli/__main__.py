import sys

from nanoserve_cli import main

sys.exit(main())
