import sys

from moe_plugins.tools.cli import main

sys.exit(main())
