import sys

from tierd.cli import main

sys.exit(main())
