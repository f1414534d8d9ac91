import sys

from attnchat.cli import main

sys.exit(main())
