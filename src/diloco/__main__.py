import sys

from diloco.cli.main import main

sys.exit(main())
