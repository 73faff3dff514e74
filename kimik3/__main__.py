import sys

from kimik3.cli import main

sys.exit(main())
