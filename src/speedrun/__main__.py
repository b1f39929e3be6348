import sys

from speedrun.cli import main

sys.exit(main())
